"""`evalkit` commands started from a process that has already imported what a run loads (torch, transformers,
lm-eval): each command is forked from it, so it is still a process of its own (its own exit status, stdout, stderr,
working directory and state) but starts in a fraction of a second instead of the ~10 s those imports take. What the
imports print is put back at the head of each command's stderr. A command whose environment differs from the one the
libraries were imported in runs as a plain subprocess (:func:`helpers.evalkit` decides).

    python tests/cli_zygote.py    # the server: reads one JSON request per line on stdin, answers one per line
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ("evalkit.compression", "evalkit.run.runner", "evalkit.lm", "lm_eval.evaluator", "hydra", "omegaconf")


class Zygote:
    """The client: one server per environment, started on first use, stopped at exit."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.server = subprocess.Popen([sys.executable, __file__], env=env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.folder = Path(tempfile.mkdtemp(prefix="evalkit-zygote-"))
        ready = json.loads(self.server.stdout.readline() or "{}")
        if "preload_stderr" not in ready:
            raise RuntimeError("the CLI zygote did not start")
        self.preamble = ready["preload_stderr"]
        self.calls = 0
        atexit.register(self.close)

    def run(self, argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        self.calls += 1
        out, err = self.folder / f"{self.calls}.out", self.folder / f"{self.calls}.err"
        request = {"argv": argv, "cwd": str(cwd), "timeout": timeout, "out": str(out), "err": str(err)}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        answer = json.loads(self.server.stdout.readline())
        stdout, stderr = out.read_text(errors="replace"), self.preamble + err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        command = [sys.executable, "-m", "evalkit.cli", *argv]
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, answer["returncode"], stdout, stderr)

    def close(self) -> None:
        import shutil

        if self.server.poll() is None:
            self.server.stdin.close()
            self.server.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


def _serve() -> None:
    """Import the libraries (what they print kept for the clients), then fork a command per request."""
    import importlib

    sys.path[0] = os.getcwd()  # as ``python -m``: the working directory first, not this folder
    control_in, control_out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    captured = tempfile.TemporaryFile()
    os.dup2(captured.fileno(), 1)
    os.dup2(captured.fileno(), 2)
    for name in PRELOAD:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    captured.seek(0)
    preamble = captured.read().decode(errors="replace")
    os.dup2(null, 1)
    os.dup2(null, 2)
    control_out.write(json.dumps({"preload_stderr": preamble}) + "\n")
    control_out.flush()
    for line in control_in:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            control_in.close()
            control_out.close()
            _command(request)
        deadline, status = time.monotonic() + request["timeout"], None
        while status is None:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(code)
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            else:
                time.sleep(0.01)
        control_out.write(json.dumps({"returncode": status, "timed_out": status is None}) + "\n")
        control_out.flush()


def _command(request: dict) -> None:
    """In the forked child: run ``python -m evalkit.cli ARGV`` in its working directory; never returns."""
    import runpy
    import threading
    import traceback

    code = 1
    try:
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]
        for fd, path in ((1, request["out"]), (2, request["err"])):  # sys.stdout and sys.stderr write to 1 and 2
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = ["-m", *request["argv"]]
        try:
            runpy.run_module("evalkit.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 (as the interpreter: the traceback and status 1)
            traceback.print_exc()
            code = 1
        threading._shutdown()  # the interpreter's own exit: non-daemon threads joined, then atexit's functions
        import atexit as exits

        exits._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001,S110
                pass
        os._exit(code)


if __name__ == "__main__":
    _serve()
