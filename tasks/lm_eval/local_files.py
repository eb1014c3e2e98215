"""What is wrong with the local files a task of lm-eval's registry reads (``task=lm_eval task.dataset.path=json`` with
``task.dataset.kwargs.data_files``), in one line naming the file.

lm-eval loads them with ``datasets``, whose builders say only "An error occurred while generating the dataset"
(``DatasetGenerationError``) for a line that does not parse, and raise a bare ``StopIteration`` for an empty file.
Where loading a task's data fails, :func:`problem` reads its local files as evalkit's own tasks read theirs
(:func:`evalkit.benchmark.data.load_rows`) and says which one is wrong and how.
"""

from __future__ import annotations

import glob
from pathlib import Path

from evalkit.benchmark.data import BUILDERS, DataError, load_rows
from evalkit.core.errors import one_line


def local_files(dataset_kwargs: dict | None) -> list[Path]:
    """The local files ``data_files`` names (a path, a list, or a list or path per split; patterns expanded)."""
    files = (dataset_kwargs or {}).get("data_files")
    values = files.values() if isinstance(files, dict) else [files]
    names = [name for value in values for name in ([value] if isinstance(value, (str, Path)) else value or [])]
    found = [Path(match) for name in names for match in sorted(glob.glob(str(Path(str(name)).expanduser())))]
    return list(dict.fromkeys(path for path in found if path.is_file()))


def problem(dataset_kwargs: dict | None, error: BaseException | None = None) -> str | None:
    """What is wrong with the first of the task's local data files that cannot be read: ``<file>: empty: no rows``,
    ``<file>: line 3: not valid JSON (...)``, ... Where each one reads, but ``error`` is ``datasets`` failing on them
    (a column whose type changes from row to row), its first cause with the files; None where no file is local or
    the failure is not theirs."""
    files = local_files(dataset_kwargs)
    for path in files:
        if not path.read_bytes().strip():
            return f"{path}: empty: no rows"
        if path.suffix not in BUILDERS:
            continue
        try:
            rows = load_rows(str(path))
        except DataError as bad:
            return str(bad)
        if not rows:
            return f"{path}: no rows"
    if files and _from_datasets(error):
        return f"{', '.join(map(str, files))}: datasets could not read them: {one_line(_first_cause(error))}"
    return None


def _from_datasets(error: BaseException | None) -> bool:
    from datasets.exceptions import DatasetsError

    return isinstance(error, (DatasetsError, StopIteration))


def _first_cause(error: BaseException) -> BaseException:
    """The exception that started ``error``'s chain (``datasets`` wraps pyarrow's and pandas' own)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return error
