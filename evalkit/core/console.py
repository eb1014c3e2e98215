"""The terminal's one voice. While a run works (:func:`libraries_to_log`), what libraries print, log or warn (lm-eval,
transformers, datasets, their progress bars) goes to the run's log file, and only evalkit's own lines reach the
terminal: :func:`say` for its messages, :func:`warn` for what concerns the user's configuration, and
:func:`stream` for its progress bar. With ``verbose`` the libraries' output reaches the terminal too."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from pathlib import Path

from evalkit.core.paths import naming

_terminal: list = []  # (stdout, stderr) of the terminal while libraries_to_log redirects sys.stdout and sys.stderr
_quiet: list[bool] = []  # per libraries_to_log block: whether evalkit's own lines go to the log as well (a sweep's job)


def stream(err: bool = True):
    """The terminal's stderr (``err``) or stdout, whatever libraries' output is redirected to meanwhile."""
    if _terminal:
        return _terminal[-1][1 if err else 0]
    return sys.stderr if err else sys.stdout


def say(text: str, err: bool = False) -> None:
    """One of evalkit's own lines, on the terminal above any progress bar (in a sweep's job: in the job's log)."""
    from tqdm import tqdm

    target = sys.stdout if _quiet and _quiet[-1] and not err else stream(err)
    tqdm.write(text, file=target)
    target.flush()


def warn(message: str) -> None:
    """A warning about the user's run, on the terminal's stderr as ``evalkit: WARNING: ...`` (each is said once per
    run by its caller; a later run in the same process, a sweep's next job, says its own again)."""
    say(f"evalkit: WARNING: {message}", err=True)


class _LazyFile:
    """A log file made (with its folder) on its first write: a run that logs nothing leaves none."""

    def __init__(self, path: Path):
        self.path, self.file = path, None

    def write(self, text: str) -> int:
        with naming(self.path):  # a full disk names the log it stopped
            if self.file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed by close())
            return self.file.write(text)

    def flush(self) -> None:
        if self.file is not None:
            with naming(self.path):
                self.file.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")  # as any stream with no descriptor: callers (Ray) fall back

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class _Tee:
    """A text stream that writes to several (the log file and, verbose, the terminal)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for target in self.streams:
            target.write(text)
        return len(text)

    def flush(self) -> None:
        for target in self.streams:
            target.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")


@contextlib.contextmanager
def libraries_to_log(log_path: Path, verbose: bool = False, quiet: bool = False):
    """Within the block, everything but evalkit's own lines goes to ``log_path`` (appended): ``sys.stdout`` and
    ``sys.stderr`` (prints, progress bars), the logging tree (every handler that wrote to the terminal) and Python
    warnings (through logging). ``verbose``: to the terminal as well. ``quiet``: evalkit's own lines too, but its
    warnings and progress bar (a sweep's job, whose one line the sweep prints). Everything is restored on the way
    out."""
    terminal = (sys.stdout, sys.stderr)
    with contextlib.closing(_LazyFile(log_path)) as log:
        out = _Tee(log, terminal[1]) if verbose else log
        handler = logging.StreamHandler(out)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        saved_root = (root.handlers[:], root.level)
        bars = _library_bars(enable=verbose)  # first: the libraries it imports add their own terminal handlers
        moved = [(h, h.stream) for h in _stream_handlers() if h.stream in (*terminal, sys.__stdout__, sys.__stderr__)]
        for moved_handler, _ in moved:
            moved_handler.setStream(out)
        root.handlers, root.level = [handler], logging.INFO
        logging.captureWarnings(True)
        _terminal.append(terminal)
        _quiet.append(quiet)
        sys.stdout = sys.stderr = out
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("default")  # each warning once per place, into the log
                yield log_path
        finally:
            sys.stdout, sys.stderr = terminal
            _terminal.pop()
            _quiet.pop()
            logging.captureWarnings(False)
            root.handlers, root.level = saved_root
            for moved_handler, previous in moved:
                moved_handler.setStream(previous)
            bars()


def _stream_handlers() -> list[logging.StreamHandler]:
    """Every stream handler of the logging tree but the root's (plain StreamHandlers, not files)."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]
    return [h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers
            if type(h) is logging.StreamHandler]


def _library_bars(enable: bool):
    """Turn the progress bars of transformers, datasets and huggingface_hub off (unless ``enable``); return what
    turns them back to how they were."""
    undo = []
    if enable:
        return lambda: None
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            undo.append(hf_logging.enable_progress_bar)
    with contextlib.suppress(ImportError):
        import datasets

        if datasets.is_progress_bar_enabled():
            datasets.disable_progress_bars()
            undo.append(datasets.enable_progress_bars)
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        if not are_progress_bars_disabled():
            disable_progress_bars()
            undo.append(enable_progress_bars)

    def restore() -> None:
        for step in undo:
            step()

    return restore


class PhaseBar:
    """The run's progress bar: requests done of all, the phase running now (``prefill``, ``warm-up``, ``decode``) and
    each phase's tokens per second once it has run a second. ``step`` is the engine's ``on_step``. In a sweep's job it
    shows under the sweep's bar while the job runs, and then goes."""

    def __init__(self, total: int, initial: int = 0, disable: bool = False):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc="generate", unit="req", file=stream(), disable=disable,
                        dynamic_ncols=True, leave=not (_quiet and _quiet[-1]))
        self.tokens: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.phase, self.shown = None, 0.0

    def step(self, phase: str, tokens: int, seconds: float) -> None:
        import time

        self.tokens[phase] = self.tokens.get(phase, 0) + tokens
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        changed = phase != self.phase
        if changed or time.monotonic() - self.shown >= 1.0:
            self.phase, self.shown = phase, time.monotonic()
            self._show(min_seconds=1.0)

    def _show(self, min_seconds: float) -> None:
        """The phase and the rate of each phase that has run ``min_seconds``."""
        rates = [f"{name} {self.tokens[name] / self.seconds[name]:,.1f} tok/s" for name in ("prefill", "decode")
                 if self.seconds.get(name, 0.0) > 0 and self.seconds[name] >= min_seconds]
        self.bar.set_description_str(f"generate · {self.phase}", refresh=False)
        self.bar.set_postfix_str(" | ".join(rates), refresh=True)

    def update(self, done: int = 1) -> None:
        self.bar.update(done)

    def close(self) -> None:
        if self.phase is not None:
            self._show(min_seconds=0.0)  # the bar's last line: each phase's rate, however short it ran
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
