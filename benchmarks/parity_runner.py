"""What every parity script (``benchmarks/parity_*.py``) shares: its arguments, its workers, the reference's
environment, a temporary folder for what both sides read, and the call to its comparison. A parity check is its sides
and its comparison::

    SIDES = {"kvpress": Side(kept_by_kvpress, reference=True), "evalkit": Side(kept_by_evalkit)}

    def compare(parity: Parity, args) -> None:
        save_model(parity.folder, args.length)                  # what both sides read
        theirs, ours = parity.both("--model", str(parity.folder))
        ...                                                     # the table

    if __name__ == "__main__":
        run_parity(__file__, __doc__, SIDES, compare, options=model_options, environment=kvpress_environment)

``python benchmarks/parity_x.py ARGS`` parses ARGS (``options`` adds the script's own arguments), finds the
reference's interpreter (``environment``; None, with a line saying why, ends the run with exit 0: kvpress 0.5.5 is made
on demand in its own environment, bench_vs_kvpress.py), makes the temporary folder and calls ``compare``.
``parity.run(side, *arguments)`` runs ``python benchmarks/parity_x.py --worker SIDE *arguments`` in the side's
environment (offline, the repository on its path): that process parses the same arguments and prints the side's
result as one ``RESULT <json>`` line, or (``Side(..., pickled=True)``: tensors) pickles it into the folder.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
KVPRESS_VENV = "/tmp/kvpress-venv"  # benchmarks/kvpress_venv.sh's default


@dataclass(frozen=True)
class Side:
    """One side of a parity check: ``compute(args)`` gives its result in its worker, from the worker's arguments."""

    compute: Callable[[argparse.Namespace], object]
    reference: bool = False  # run by the reference's interpreter (else by evalkit's, this one)
    pickled: bool = False  # its result comes back pickled (tensors) instead of as a RESULT line


@dataclass(frozen=True)
class Parity:
    """What a comparison is handed: the sides, the reference's interpreter and the folder both sides read from."""

    script: Path
    sides: dict[str, Side]
    python: Path
    folder: Path

    def run(self, side: str, *arguments: str):
        """``side``'s result on ``arguments``, from its worker in its own environment."""
        from bench_vs_kvpress import run_worker

        python = self.python if self.sides[side].reference else Path(sys.executable)
        if not self.sides[side].pickled:
            return run_worker(python, self.script, side, *arguments)
        result = self.folder / f"{side}-result.pickle"
        done = subprocess.run([str(python), str(self.script), "--worker", side, *arguments, "--result", str(result)],
                              capture_output=True, text=True, env=worker_environment())
        if done.returncode != 0:
            raise SystemExit(f"{side} worker failed: {done.stderr.strip()[-1500:]}")
        with result.open("rb") as saved:
            return pickle.load(saved)

    def both(self, *arguments: str) -> list:
        """Every side's result on the same ``arguments``, in the order the sides are declared."""
        return [self.run(side, *arguments) for side in self.sides]


def worker_environment() -> dict[str, str]:
    """The variables a worker runs with: offline, the repository on its path (as bench_vs_kvpress.run_worker's)."""
    return {"PYTHONPATH": str(HERE.parent), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def kvpress_environment(args: argparse.Namespace) -> Path | None:
    """kvpress 0.5.5's interpreter in ``args.venv``, made on demand; None (a line says why) where it cannot be."""
    from bench_vs_kvpress import kvpress_python

    return kvpress_python(Path(args.venv))


def venv_option(parser: argparse.ArgumentParser, default: str = KVPRESS_VENV) -> None:
    """``--venv``: kvpress' environment (:func:`kvpress_environment`)."""
    parser.add_argument("--venv", default=default)


def write_fixture(path: str, recorded: dict) -> None:
    """kvpress' side as recorded (``--write``): the fixture a test checks evalkit against."""
    Path(path).write_text(json.dumps({"reference": "kvpress 0.5.5", **recorded}, separators=(",", ":")) + "\n")


def from_tests(name: str):
    """A helper module of tests/ (conftest's tiny model, learned_files' writers of publishers' formats)."""
    if str(HERE.parent / "tests") not in sys.path:
        sys.path.insert(0, str(HERE.parent / "tests"))
    return importlib.import_module(name)


def run_parity(script: str, doc: str, sides: dict[str, Side], compare: Callable[[Parity, argparse.Namespace], None],
               *, options: Callable[[argparse.ArgumentParser], None] | None = None,
               check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
               environment: Callable[[argparse.Namespace], Path | None] | None = None) -> None:
    """The script's command line: a worker's side (``--worker SIDE``), or the comparison. ``check(parser, args)``
    refuses arguments the comparison cannot run with (``parser.error``); ``environment`` None: the reference needs no
    interpreter of its own."""
    parser = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    parser.add_argument("--worker", choices=list(sides), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    if options is not None:
        options(parser)
    args = parser.parse_args()
    if args.worker:
        result = sides[args.worker].compute(args)
        if args.result:
            with open(args.result, "wb") as out:
                pickle.dump(result, out)
        else:
            from bench_vs_kvpress import report

            report(result)
        return
    if check is not None:
        check(parser, args)
    python = Path(sys.executable) if environment is None else environment(args)
    if python is None:
        return
    with tempfile.TemporaryDirectory() as folder:
        compare(Parity(Path(script).resolve(), sides, python, Path(folder)), args)
