"""Shared test helpers (the tests folder is on sys.path under pytest)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def evalkit(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the `evalkit` CLI offline in ``cwd``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
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
