"""The sandbox contains hostile programs: each is scored as a failure and leaves the harness and the host untouched."""

from __future__ import annotations

import os
import shutil
import socket
import threading

import pytest

from evalkit.benchmark import sandbox

ISOLATED = sandbox.isolation()["namespaces"]
needs_namespaces = pytest.mark.skipif(not ISOLATED, reason="Linux namespaces unavailable: network/pid/fs not isolated")


def test_namespaces_are_used_wherever_the_machine_offers_them():
    """The sandbox must not silently fall back to rlimits only (e.g. because its python sits under /tmp)."""
    import shutil
    import subprocess

    command = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc", "true"]
    if not shutil.which("unshare") or subprocess.run(command, capture_output=True).returncode != 0:
        pytest.skip("this machine offers no unprivileged namespaces")
    assert sandbox.isolation()["namespaces"]


def test_ordinary_program_reads_stdin_and_writes_stdout():
    result = sandbox.run("a, b = map(int, input().split())\nprint(a + b)", stdin="2 40\n")
    assert (result.status, result.returncode, result.stdout) == ("ok", 0, "42\n")


def test_error_and_exit_codes_are_reported():
    result = sandbox.run("raise ValueError('boom')")
    assert result.status == "error" and result.returncode == 1 and "ValueError: boom" in result.stderr


def test_infinite_loop_times_out_on_the_wall_clock():
    result = sandbox.run("while True:\n    pass", timeout_s=1.0)
    assert result.status == "timeout" and result.duration_s < 5


def test_memory_bomb_is_refused():
    result = sandbox.run("blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))", memory_mb=256)
    assert result.status == "memory"


def test_fork_bomb_is_contained_and_cleaned_up():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = sandbox.run(code, timeout_s=2.0)
    assert result.status in ("timeout", "killed")
    after = sandbox.run("print('still working')")
    assert after.stdout == "still working\n"


def test_deep_recursion_crash_is_a_failure():
    code = "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1) + 1\nf(0)"
    result = sandbox.run(code, timeout_s=3.0, memory_mb=512)
    assert result.status != "ok"


def test_huge_file_is_capped(tmp_path):
    code = "with open('big', 'wb') as f:\n    for _ in range(10 * 1024):\n        f.write(b'x' * (1 << 20))"
    result = sandbox.run(code, timeout_s=10.0)
    assert result.status != "ok" and "File too large" in result.stderr


def test_gigabyte_of_stdout_is_capped():
    result = sandbox.run("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))", timeout_s=10.0)
    assert result.status != "ok"
    assert len(result.stdout) <= sandbox.OUTPUT_LIMIT_MB << 20


def test_parent_environment_secret_is_not_visible(monkeypatch):
    monkeypatch.setenv("EVALKIT_CANARY_SECRET", "hunter2")
    result = sandbox.run("import os\nprint(os.environ.get('EVALKIT_CANARY_SECRET', 'absent'))")
    assert result.stdout == "absent\n"


def test_sys_exit_zero_prints_nothing():
    result = sandbox.run("import sys\nsys.exit(0)\nprint('never')")
    assert result.status == "ok" and result.stdout == ""


def test_temporary_directories_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    sandbox.run("open('left_behind', 'w').write('x')")
    assert list(tmp_path.iterdir()) == []


@needs_namespaces
def test_canary_file_outside_the_sandbox_cannot_be_deleted(tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("alive")
    result = sandbox.run(f"import os\nos.remove({str(canary)!r})")
    assert result.status == "error"
    assert canary.read_text() == "alive"


@needs_namespaces
def test_parent_process_cannot_be_killed():
    code = f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass"
    sandbox.run(code)
    assert sandbox.run("print('harness alive')").stdout == "harness alive\n"  # this test process survived


@needs_namespaces
def test_no_network_even_to_localhost():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(_accept(listener)), daemon=True)
    thread.start()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\nprint('connected')"
    result = sandbox.run(code)
    listener.close()
    thread.join(timeout=3)
    assert result.status == "error" and "connected" not in result.stdout
    assert accepted in ([], [None])


def _accept(listener):
    listener.settimeout(3)
    try:
        return listener.accept()
    except OSError:
        return None


def test_run_many_keeps_order_on_a_bounded_pool():
    jobs = [{"code": f"print({i} * {i})", "timeout_s": 5.0} for i in range(6)]
    results = sandbox.run_many(jobs, workers=2)
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="timeout_s"):
        sandbox.run("print(1)", timeout_s=0)


# A non-root user (the tests run as root, which the process limit exempts) grades with more sandboxes at once than
# the per-sandbox process limit, while the grading process itself holds many threads.
_AS_NOBODY = r"""
import json, sys, threading
from evalkit.benchmark import sandbox
sandbox.MAX_PROCESSES = 8
hold = threading.Event()
for _ in range(16):  # many threads in the harness: they count as the user's processes too
    threading.Thread(target=hold.wait, daemon=True).start()
jobs = [{"code": f"import subprocess; print(subprocess.run(['true']).returncode + {i})", "timeout_s": 20.0}
        for i in range(36)]
results = sandbox.run_many(jobs, workers=12)
greedy = sandbox.run("import subprocess\nchildren = [subprocess.Popen(['sleep', '5']) for _ in range(12)]", timeout_s=20)
hold.set()
print(json.dumps({"isolation": sandbox.isolation(), "statuses": [r.status for r in results],
                  "greedy": [greedy.status, "BlockingIOError" in greedy.stderr],
                  "stdout": [r.stdout for r in results], "stderr": [r.stderr[-300:] for r in results if r.status != "ok"]}))
"""


# Where the interpreter sits under root's home (pyenv), the test runs in a private mount namespace in which that
# home is an empty world-searchable tmpfs that shows only the interpreter's folder: nobody can then run it.
_EXPOSE_INTERPRETER = r"""
set -e
home=$(dirname "$1"); keep=$(mktemp -d)
mount --bind "$1" "$keep"
mount -t tmpfs -o mode=755 tmpfs "$home"
mkdir -p "$1" && mount --bind "$keep" "$1"
shift
exec "$@"
"""


@pytest.mark.skipif(os.geteuid() != 0 or not all(map(shutil.which, ("setpriv", "unshare"))),
                    reason="dropping privileges needs root, setpriv and unshare")
def test_a_non_root_user_grades_with_more_sandboxes_than_the_process_limit():
    """As user nobody (root is exempt from the process limit), with many threads in the grading process and more
    sandboxes at once than the limit: every trivial program runs, in the namespaces wherever root gets them."""
    import json
    import subprocess
    import sys

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "TMPDIR": "/tmp",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", _AS_NOBODY]
    interpreter = os.path.realpath(sys.base_prefix)
    hidden = next((p for p in (interpreter, *map(str, __import__("pathlib").Path(interpreter).parents))
                   if os.path.dirname(p) and not os.stat(p).st_mode & 0o001), None)
    if hidden is not None:  # a folder on the way that others cannot search, e.g. /root
        exposed = os.path.join(hidden, os.path.relpath(interpreter, hidden).split(os.sep)[0])
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _EXPOSE_INTERPRETER, "expose",
                   exposed, *command]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd="/tmp", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["statuses"] == ["ok"] * 36, report["stderr"][:3]
    assert report["stdout"] == [f"{i}\n" for i in range(36)]
    assert report["isolation"]["namespaces"] == ISOLATED  # the threads did not make the probe fall back
    assert report["greedy"] == ["error", True]  # and the limit still holds: one sandbox cannot start 12 children
