"""Where ``evalkit-report`` and its subcommands write, and how they refuse: a folder that cannot take their files and
a results directory that cannot be read are one line on stderr and exit status 2, and a command that fails part way
removes what it wrote."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from .tables import ResultsError


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose mistakes are one line, ``<prog>: <what is wrong>`` and exit status 2, as the
    program's other refusals (argparse's own answer starts with the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help shows the arguments)\n")


def output_folder(folder: str | os.PathLike, parents: bool = True) -> Path:
    """``folder`` made where missing (its missing parents too, unless ``parents`` is false), or
    :class:`ResultsError` naming it: a file, under a file, not writable, a missing parent."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ResultsError(f"{folder} is a file, not a folder")
    above = next(p for p in [*folder.parents, Path("/")] if p.exists())  # the nearest folder (or file) that exists
    if not above.is_dir():
        raise ResultsError(f"{folder}: {above} is a file, not a folder")
    if not parents and above != folder.parent:
        raise ResultsError(f"{folder}: its folder {folder.parent} does not exist")
    try:
        folder.mkdir(parents=parents, exist_ok=True)
    except OSError as error:
        raise ResultsError(f"{folder}: cannot make this folder: {error.strerror or error}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ResultsError(f"{folder}: not writable")
    return folder


@contextlib.contextmanager
def writing_into(folder: str | os.PathLike, parents: bool = True):
    """``folder`` made (:func:`output_folder`) for the block's files; if the block fails, what it added there (and
    the folders made for it) is removed again. Files it replaced stay replaced."""
    folder = Path(folder)
    made = [p for p in [folder, *folder.parents] if not p.exists()]  # deepest first
    before = set(folder.rglob("*")) if folder.is_dir() else set()
    try:
        yield output_folder(folder, parents)
    except BaseException:
        added = set(folder.rglob("*")) - before if folder.is_dir() else set()
        for path in sorted(added, reverse=True):  # what lies inside a folder before the folder
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()
                else:
                    path.unlink()
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


@contextlib.contextmanager
def refusing(program: str):
    """A :class:`ResultsError` (a damaged table, a folder that cannot be written) or an OSError in the block: one line
    on stderr, ``<program>: <what is wrong>``, and exit status 2."""
    try:
        yield
    except ResultsError as error:
        print(f"{program}: {error}", file=sys.stderr)
        sys.exit(2)
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        print(f"{program}: {where}{error.strerror or error}", file=sys.stderr)
        sys.exit(2)

