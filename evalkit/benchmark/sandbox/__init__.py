"""Run untrusted Python (generated code) in an isolated, resource-limited child process.

    from evalkit.benchmark import sandbox
    result = sandbox.run("print(input()[::-1])", stdin="abc\\n", timeout_s=6.0, memory_mb=2048)
    result.status, result.returncode, result.stdout, result.stderr

What every run gets, always:
  * its own process group (the whole group is SIGKILLed on the wall-clock timeout) and a fresh temporary directory,
    removed afterwards;
  * a scrubbed environment (no variable of the parent is passed on) and Python's isolated mode (``-I``);
  * rlimits: CPU time, address space (``memory_mb``; by default a safety cap of the machine's physical memory),
    processes, file size (caps every file it writes, stdout and stderr included), open files, no core dumps.

The process limit counts per user, threads included, so set on the program it would count every process of the user
who grades (the harness's threads and every other sandbox) and make ordinary programs fail to start on a machine
with many cores. With namespaces it is set inside the sandbox's own user namespace, where the kernel counts only that
sandbox's processes; without them, it is the user's current count plus :data:`MAX_PROCESSES` for every sandbox that
may run beside it (:func:`run_many`'s pool).

Where Linux namespaces are available (:func:`isolation` says), the program also runs in new user, PID, mount and
network namespaces: no network but an unconfigured loopback, no view of any process outside (it cannot signal the
harness), the whole filesystem remounted read-only with a private size-capped tmpfs as its working directory (and
on /dev/shm), and an inner user namespace without capabilities so that it cannot undo any of this. Where they are not,
the rlimits, process group, scrubbed environment and timeouts still hold, but network, other processes and files the
user can write are reachable; :func:`isolation` reports which case applies, says so once on stderr when it is the
weaker one, and every LiveCodeBench result records it.

Each run's temporary folder is ``evalkit-sandbox-<grader pid>-<random>`` in the system's temporary directory
(``$TMPDIR``, else /tmp). It is removed when the run ends, and when the grading process ends early: on exit
(``atexit``) and on SIGTERM or SIGHUP (where the program left their default action), its running sandboxes are
killed and their folders removed before it dies of the signal. A ``kill -9`` of the grader leaves them (its
sandboxes die with it: ``setpriv --pdeathsig``); the next process that uses the sandbox removes the folders of graders
that are gone (:func:`remove_stale_folders`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from evalkit.core.console import warn

log = logging.getLogger(__name__)

STATUSES = ("ok", "timeout", "memory", "error", "killed")
OUTPUT_LIMIT_MB = 64
MAX_PROCESSES = 64
MAX_OPEN_FILES = 64

# Runs inside the namespaces, before the untrusted code: $1 = code file, $2 = python, $3 = an empty folder that becomes
# the program's root, $4 = the size of its writable tmpfs folders, $5 = the process limit (set here so that the kernel
# counts it in the sandbox's own user namespace), then (path, remount options) pairs: the Python runtime and the system
# libraries, bound read-only. Nothing else of the host is in the program's view: no data file, no home folder, no
# host /tmp. Its working folder /work and /tmp are private size-capped tmpfs; /dev holds null, zero, random and
# urandom; /proc is the sandbox's own PID namespace. Any step that fails stops the launch (fail closed).
_LAUNCHER = r"""
exec 3<"$1" || exit 125
python=$2; root=$3; size=$4; nproc=$5; shift 5
mount -t tmpfs -o size=1m,mode=0755 tmpfs "$root" || exit 125
mkdir -p "$root/dev/shm" "$root/proc" "$root/tmp" "$root/work" && ln -s /proc/self/fd "$root/dev/fd" || exit 125
mount -t tmpfs -o "size=$size,mode=0700" tmpfs "$root/work" || exit 125
mount -t tmpfs -o "size=$size,mode=1777" tmpfs "$root/tmp" || exit 125
while [ $# -gt 1 ]; do
  path=$1; options=$2; shift 2
  if [ -L "$path" ]; then
    mkdir -p "$root${path%/*}" && ln -s "$(readlink "$path")" "$root$path" || exit 125
  else
    mkdir -p "$root$path" && mount --bind "$path" "$root$path" && mount -o "$options" "$root$path" || exit 125
  fi
done
for device in null zero random urandom; do
  : > "$root/dev/$device" && mount --bind "/dev/$device" "$root/dev/$device" || exit 125
done
mount --rbind /proc "$root/proc" || exit 125
mount -t tmpfs -o size=1m tmpfs "$root/dev/shm" || exit 125
mount -o remount,bind,ro,nosuid,nodev "$root" || exit 125
exec prlimit --nproc="$nproc:$nproc" -- unshare --user --mount --root="$root" --wd=/work "$python" -I /dev/fd/3
"""
_NAMESPACES = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """``status``: ok (exit 0), timeout (wall clock or CPU limit), memory (allocation refused), error (non-zero exit),
    killed (ended by a signal, e.g. a file or output over the size cap)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float


@functools.lru_cache(maxsize=1)
def isolation() -> dict:
    """Which protections this machine enforces: always rlimits/process group/env; namespaces when they work here.
    Probed once; the weaker case is said once, on stderr, and :func:`isolation_level` names it for the results."""
    namespaces, why = False, "unshare, prlimit or sh missing, or not Linux"
    remove_stale_folders()
    _clean_up_on_exit()
    if all(map(shutil.which, ("unshare", "prlimit", "sh"))) and sys.platform.startswith("linux"):
        probe = _run("import sys; sys.stdout.write('ok')", "", 10.0, 256, use_namespaces=True)
        namespaces = probe.status == "ok" and probe.stdout == "ok"
        why = probe.stderr.strip()[-200:] or f"probe status {probe.status}"
    if not namespaces:
        message = (f"sandbox: Linux namespaces unavailable ({why}); generated code runs with rlimits, a process group "
                   "and a scrubbed environment only: it can reach the network, other processes and the user's files")
        log.warning(message)
        warn(message)
    return {"rlimits": True, "process_group": True, "scrubbed_env": True, "namespaces": namespaces,
            "network_blocked": namespaces, "read_only_filesystem": namespaces, "pid_isolation": namespaces}


def isolation_level() -> str:
    """``namespaces`` (the full sandbox) or ``rlimits`` (the weaker fallback)."""
    return "namespaces" if isolation()["namespaces"] else "rlimits"


def safety_memory_mb() -> int:
    """The address-space cap when none is asked for: the machine's physical memory, which no program that passes a
    test needs to exceed, but which keeps a runaway program from taking the host down with it."""
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) >> 20


def run(code: str, stdin: str = "", timeout_s: float = 6.0, memory_mb: int | None = None) -> SandboxResult:
    """Run ``code`` as a Python program with ``stdin``; never raises for anything the program does. ``memory_mb``:
    the address-space cap (None: :func:`safety_memory_mb`)."""
    memory_mb = safety_memory_mb() if memory_mb is None else memory_mb
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout_s and memory_mb must be positive, got {timeout_s}, {memory_mb}")
    return _run(code, stdin, timeout_s, memory_mb, use_namespaces=isolation()["namespaces"])


def default_workers() -> int:
    """One program per core."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


_concurrent = [1]  # sandboxes that may run at once (run_many's pool): the fallback's process limit allows for each


def run_many(jobs: list[dict], workers: int | None = None) -> list[SandboxResult]:
    """Run many programs (each a dict of :func:`run`'s arguments) on a bounded pool; results in the jobs' order."""
    workers = max(1, min(len(jobs), workers or default_workers()))
    isolation()  # probe once, before the threads start
    _concurrent.append(workers)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda job: run(**job), jobs))
    finally:
        _concurrent.remove(workers)


def _limits(timeout_s: float, memory_mb: int, processes: int | None) -> dict[str, tuple[int, int]]:
    """The rlimits of a run; ``processes`` None leaves the process limit to the launcher inside the namespaces."""
    cpu = int(timeout_s) + 1
    limits = {"CPU": (cpu, cpu + 1), "AS": (memory_mb << 20,) * 2, "FSIZE": (OUTPUT_LIMIT_MB << 20,) * 2,
              "NOFILE": (MAX_OPEN_FILES,) * 2, "CORE": (0, 0)}
    return limits | ({"NPROC": (processes,) * 2} if processes is not None else {})


def _user_tasks() -> int:
    """Processes and threads of this real user now: what the kernel holds the process limit against."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "status"), encoding="ascii", errors="replace") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue  # ended meanwhile
    return count


def _limited(command: list[str], limits: dict[str, tuple[int, int]]):
    """``command`` under ``limits``: through util-linux ``prlimit`` (safe with the threads of :func:`run_many`), else
    set in the child before exec."""
    if shutil.which("prlimit"):
        return ["prlimit", *(f"--{name.lower()}={soft}:{hard}" for name, (soft, hard) in limits.items()), "--", *command], None

    def apply() -> None:
        for name, values in limits.items():
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), values)

    return command, apply


_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_MOUNT_FLAGS = ((os.ST_NOSUID, "nosuid"), (os.ST_NODEV, "nodev"), (os.ST_NOEXEC, "noexec"), (os.ST_NOATIME, "noatime"),
                (os.ST_NODIRATIME, "nodiratime"), (os.ST_RELATIME, "relatime"))


@functools.lru_cache(maxsize=1)
def runtime_view() -> tuple[tuple[str, str], ...]:
    """What of the host a sandboxed program sees, read-only: the system libraries and this Python's installation
    (its prefix and, in a virtual environment, the base one), as (path, remount options) pairs. The options keep the
    flags the host mount already has (a user namespace may not drop them) and add ``ro``."""
    prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    candidates = sorted({path for path in (*_SYSTEM_PATHS, *prefixes) if os.path.lexists(path) and path != os.sep})
    view: list[tuple[str, str]] = []
    for path in candidates:
        if any(path.startswith(kept.rstrip(os.sep) + os.sep) and not os.path.islink(kept) for kept, _ in view):
            continue  # inside a folder already in the view
        flags = 0 if os.path.islink(path) else os.statvfs(path).f_flag
        view.append((path, ",".join(["remount", "bind", "ro", *(name for bit, name in _MOUNT_FLAGS if flags & bit)])))
    return tuple(view)


_TEMP_PREFIX = "evalkit-sandbox-"


def remove_stale_folders() -> list[str]:
    """Remove the temporary folders of sandboxes whose grading process is gone (killed before it could clean up);
    each folder's name carries its grader's pid. Returns what was removed. Called once per process, on first use."""
    removed = []
    root = tempfile.gettempdir()
    for entry in os.scandir(root):
        owner = entry.name[len(_TEMP_PREFIX):].split("-", 1)[0]
        if not entry.name.startswith(_TEMP_PREFIX) or not owner.isdigit() or int(owner) == os.getpid():
            continue
        try:
            os.kill(int(owner), 0)
            continue  # its grader still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


# This process's running sandboxes: their temporary folder -> their process (None until it starts), what an early
# exit removes. Only the process that made a folder removes it (a forked child inherits the dict, not the folders).
_LIVE: dict[str, subprocess.Popen | None] = {}
_LIVE_LOCK = threading.RLock()  # reentrant: the signal handler may run while the main thread holds it
_ON_EXIT = []  # set once the exit cleanup is installed


def _remove_live_folders() -> None:
    """Kill the process group of each sandbox this process is running and remove its temporary folder."""
    with _LIVE_LOCK:
        live = [(path, process) for path, process in _LIVE.items()
                if os.path.basename(path).startswith(f"{_TEMP_PREFIX}{os.getpid()}-")]
    for path, process in live:
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(path, ignore_errors=True)


def _die_of(signum: int, frame) -> None:
    """SIGTERM or SIGHUP: the sandboxes' folders removed, then the signal's default action (the exit status a
    process killed by it has)."""
    _remove_live_folders()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _clean_up_on_exit() -> None:
    """Remove the running sandboxes' folders when this process exits, or is ended by SIGTERM or SIGHUP whose
    action is still the default (a handler the program set is left alone; signals are set from the main thread
    only)."""
    if _ON_EXIT:
        return
    _ON_EXIT.append(True)
    atexit.register(_remove_live_folders)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _die_of)


def _run(code: str, stdin: str, timeout_s: float, memory_mb: int, use_namespaces: bool) -> SandboxResult:
    host_dir = tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-")
    with _LIVE_LOCK:
        _LIVE[host_dir] = None
    try:
        paths = {name: os.path.join(host_dir, name) for name in ("main.py", "stdin", "stdout", "stderr")}
        with open(paths["main.py"], "w", encoding="utf-8") as handle:
            handle.write(code)
        with open(paths["stdin"], "w", encoding="utf-8") as handle:
            handle.write(stdin)
        work = os.path.join(host_dir, "work")
        os.mkdir(work)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "HOME": work, "TMPDIR": work}
        if use_namespaces:
            root = os.path.join(host_dir, "root")
            os.mkdir(root)
            env["HOME"] = env["TMPDIR"] = "/work"
            command = [*_NAMESPACES, "sh", "-c", _LAUNCHER, "launcher", paths["main.py"], sys.executable, root, "64m",
                       str(MAX_PROCESSES), *(item for pair in runtime_view() for item in pair)]
            cwd, processes = "/", None
        else:
            command, cwd = [sys.executable, "-I", paths["main.py"]], work
            processes = MAX_PROCESSES * sum(_concurrent) + (_user_tasks() if os.getuid() != 0 else 0)
        with open(paths["stdin"], "rb") as fin, open(paths["stdout"], "wb") as fout, open(paths["stderr"], "wb") as ferr:
            start = time.monotonic()
            command, preexec = _limited(command, _limits(timeout_s, memory_mb, processes))
            if shutil.which("setpriv"):  # the sandbox dies with the thread that runs it, even on a kill -9 of the grader
                command = ["setpriv", "--pdeathsig", "KILL", "--", *command]
            process = subprocess.Popen(
                command, stdin=fin, stdout=fout, stderr=ferr, cwd=cwd, env=env, preexec_fn=preexec,  # noqa: PLW1509
                start_new_session=True, close_fds=True,
            )
            with _LIVE_LOCK:
                _LIVE[host_dir] = process
            timed_out = False
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:  # also when the wait is interrupted (Ctrl-C): the program does not outlive its run
                _kill_group(process)
            duration = time.monotonic() - start
        stdout, stderr = _read(paths["stdout"]), _read(paths["stderr"])
        return SandboxResult(_status(process.returncode, stderr, timed_out), process.returncode, stdout, stderr, duration)
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)
        with _LIVE_LOCK:
            _LIVE.pop(host_dir, None)


def _kill_group(process: subprocess.Popen) -> None:
    # Whatever the program left behind in its group goes too (kill-child tears the PID namespace down with it).
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _read(path: str, limit: int = OUTPUT_LIMIT_MB << 20) -> str:
    with open(path, "rb") as handle:
        return handle.read(limit).decode("utf-8", errors="replace")


def _status(returncode: int, stderr: str, timed_out: bool) -> str:
    if timed_out or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "timeout"
    if returncode == 0:
        return "ok"
    if "MemoryError" in stderr[-2000:]:
        return "memory"
    if returncode < 0 or returncode > 128:  # a signal (unshare reports its child's as 128 + signal)
        return "killed"
    return "error"
