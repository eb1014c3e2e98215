"""Shared test helpers (the tests folder is on sys.path under pytest)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_ZYGOTE: list = []  # the cli_zygote.Zygote of the session's environment, once started


def evalkit(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the `evalkit` CLI offline in ``cwd``: a process of its own, forked from one that has imported the
    libraries (:mod:`cli_zygote`; imported again where a test changed the environment since), or a fresh interpreter
    with EVALKIT_TESTS_FRESH_PROCESS=1."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if os.environ.get("EVALKIT_TESTS_FRESH_PROCESS") != "1":
        from cli_zygote import Zygote

        own = {key: value for key, value in env.items() if key != "PYTEST_CURRENT_TEST"}  # pytest's, set per test
        if _ZYGOTE and _ZYGOTE[0].env != own:  # a test changed the environment: libraries import again in it
            _ZYGOTE.pop().close()
        if not _ZYGOTE:
            _ZYGOTE.append(Zygote(own))
        return _ZYGOTE[0].run(list(args), cwd, timeout)
    return subprocess.run(
        [sys.executable, "-m", "evalkit.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def interruptible() -> None:
    """In a child: Ctrl-C's default action, even where the tests run with SIGINT ignored (a background job's)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted_run(args: list[str], results: Path, cwd: Path, sig: int = signal.SIGKILL, after: int = 5):
    """Start the CLI, send ``sig`` once its progress file holds ``after`` generations; the ended process, its stderr
    and the progress file's lines at the end."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "evalkit.cli", *args], cwd=cwd, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    deadline, files = time.time() + 300, []
    while time.time() < deadline and process.poll() is None:
        files = list((results / ".progress").glob("*.jsonl")) if (results / ".progress").is_dir() else []
        if files and len(files[0].read_text().splitlines()) >= after:
            process.send_signal(sig)
            break
        time.sleep(0.05)
    _, stderr = process.communicate(timeout=120)
    return process, stderr, files[0].read_text().splitlines() if files else []


def worker_threads() -> int:
    """The cores this test process may use: its pytest-xdist worker's share (conftest sets OMP_NUM_THREADS), else two,
    the CI machine's; more threads than cores make torch's OpenMP threads spin against the other worker's."""
    return int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1))
