"""lm-eval's side of a run's task: its index over evalkit's tasks, and a task built from its config, its data loaded
and checked. What a task is (its config with the run's options, its members and hooks) is :mod:`evalkit.task`."""

from __future__ import annotations

import functools

from evalkit.errors import RunError, one_line
from evalkit.paths import tasks_dir


@functools.lru_cache(maxsize=1)
def task_manager():
    """lm-eval's task index over evalkit's tasks only (indexing lm-eval's own thousands of tasks takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir()), include_defaults=False)


def task_object(config: dict):
    """The lm-eval task built from its config dict (dataset loaded)."""
    (task,) = task_manager().load([config])["tasks"].values()
    return task


def load_task(config: dict):
    """The task with its data loaded and checked, and the rows it skipped (``bad_rows=skip``). A malformed file or
    row is a :class:`RunError` naming the file, the row and the field."""
    from evalkit.scoring.data import DataError, collecting_skipped_rows

    with collecting_skipped_rows() as skipped:
        try:
            task = task_object(config)
        except DataError as error:
            raise RunError(f"data: {error}") from None
        except (ValueError, AssertionError, ImportError) as error:  # a task that builds its data refused (RULER)
            raise RunError(f"task {config.get('task')} could not build its data: {one_line(error)}") from None
        except (ConnectionError, FileNotFoundError) as error:  # a hub dataset that is not here and cannot be fetched
            source = f"dataset {config['dataset_path']}" if config.get("dataset_path") else "the data it is built from"
            raise RunError(f"data of task {config.get('task')}: {source} cannot be loaded here ({one_line(error)}); "
                           "load it once where the hub can be reached (HF_DATASETS_CACHE sets where it is kept) or "
                           "point task.dataset.path (and task.dataset.kwargs.data_files) at local files") from None
    return task, skipped
