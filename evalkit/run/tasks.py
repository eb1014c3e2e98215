"""lm-eval's side of a run's task: its index over evalkit's tasks, and a task built from its config, its data loaded
and checked. What a task is (its config with the run's options, its members and hooks) is :mod:`evalkit.benchmark`."""

from __future__ import annotations

import functools
from pathlib import Path

from evalkit.core.errors import ConfigError, RunError, one_line
from evalkit.core.paths import conf_dir, tasks_dir


@functools.lru_cache(maxsize=1)
def task_manager():
    """lm-eval's task index over evalkit's tasks only (indexing lm-eval's own thousands of tasks takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir()), include_defaults=False)


def task_object(config: dict):
    """The lm-eval task built from its config dict (dataset loaded)."""
    (task,) = task_manager().load([config])["tasks"].values()
    return task


def load_task(config: dict, limit: int | None = None):
    """The task with its data loaded and checked (its first ``limit`` good docs, where the run takes only those), and
    the rows it skipped (``bad_rows=skip``). A malformed file or row is a :class:`RunError` naming the file, the row
    and the field."""
    from evalkit.benchmark.data import DataError, collecting_skipped_rows
    from evalkit.tasks.lm_eval.local_files import problem

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
        except Exception as error:  # datasets on local files: a line that does not parse, an empty file
            found = problem(config.get("dataset_kwargs"), error)
            if found is None:
                raise
            raise RunError(f"data: {found}") from None
    return task, skipped + _held_to_rows(task, config, limit)


def _held_to_rows(task, config: dict, limit: int | None) -> list[str]:
    """The task's documents held to the fields its schema.py declares (``ROWS``): a bad one is a RunError naming the
    data, the row and the field, or, with ``bad_rows=skip``, left out of the task; returns a line for each left out.
    A task of lm-eval's registry declares none."""
    from evalkit.benchmark.data import DataError
    from evalkit.benchmark.doc_check import checked_docs
    from evalkit.config.run_schema import row_keys

    keys = row_keys(config.get("task"))
    split = config.get("test_split")
    if not keys or split is None or split not in (task.dataset or {}):
        return []
    dataset = config.get("dataset_kwargs") or {}
    where = str(dataset.get("path") or f"task {config.get('task')}'s data")
    try:
        kept, skipped = checked_docs(task.dataset[split], keys, where, dataset.get("bad_rows", "error"), limit)
    except DataError as error:
        raise RunError(f"data: {error}") from None
    if skipped:
        task.dataset[split] = task.dataset[split].select(kept)
        task.task_docs = task.eval_docs
    return skipped


# lm-eval's loaders of local files (a task's dataset_path with data_files): nothing to download
LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")


def fitting(spec, configs: list[dict], load):
    """``load()`` (the task's data: the task configs ``configs`` loaded and checked) with the task checked against
    the model's context (:func:`check_fit`): before the data where it is downloaded or built (nothing fetched for a
    run that cannot be), after it where it is read from local files (their own mistakes said first); always before
    the model loads."""
    local = all(_local_data(config) for config in configs)
    if not local:
        check_fit(spec, configs)
    loaded = load()
    if local:
        check_fit(spec, configs)
    return loaded


def _local_data(config: dict) -> bool:
    """Whether a task config reads its data from local files."""
    kwargs = config.get("dataset_kwargs") or {}
    if config.get("dataset_path") in LOCAL_LOADERS:
        return True
    path = kwargs.get("path") or config.get("dataset_path")
    return isinstance(path, str) and Path(path).expanduser().exists()


def check_fit(spec, configs: list[dict]) -> None:
    """A ConfigError (one line, naming how to choose a model) where the task's prompts cannot fit the model's context
    (``model.max_context``): the tokens it generates (its ``max_gen_toks``, where the task config gives it) leave no
    room for a prompt, or the prompt lengths its data declares (needle's ``lengths``, for data built at run time; file
    and hub data are held to the context prompt by prompt, :mod:`evalkit.lm.context_fit`) exceed the room left."""
    from evalkit.benchmark import task_of

    origin = task_of(spec.task, spec.task_options).data_origin(configs)
    generated = not (origin.source or origin.hubs)
    for config in configs:
        if config.get("output_type", "generate_until") != "generate_until":
            continue
        reserve = (config.get("generation_kwargs") or {}).get("max_gen_toks")
        reserve = reserve if isinstance(reserve, int) and not isinstance(reserve, bool) else None
        room = spec.max_context - (reserve or 0)
        lengths = (config.get("dataset_kwargs") or {}).get("lengths") if generated else None
        longest = max(lengths) if isinstance(lengths, list) and lengths and all(
            isinstance(n, int | float) for n in lengths) else None
        if reserve is not None and room < 1:
            problem = (f"task {spec.task} generates up to {reserve} tokens (task.generation.max_gen_toks), which leaves "
                       f"no room for a prompt in the {spec.max_context}-token context of model {spec.model_name} "
                       "(model.max_context)")
            lower, longer = "lower task.generation.max_gen_toks", "model.max_context where the model takes more"
        elif longest is not None and longest > room:
            problem = (f"task {spec.task}'s prompts of up to about {longest:g} tokens (task.dataset.lengths) do not fit "
                       f"the {spec.max_context}-token context of model {spec.model_name} (model.max_context) with "
                       f"{reserve or 0} tokens to generate")
            need = int(-(-(longest + (reserve or 0)) // 1024)) * 1024  # rounded up to a multiple of 1,024
            lower, longer = "shorten task.dataset.lengths", f"model.max_context={need} where the model takes that many"
        else:
            continue
        if str(spec.pretrained).startswith("builtin:"):
            models = sorted(path.stem for path in (conf_dir() / "model").glob("*.yaml") if path.stem != spec.model_name)
            raise ConfigError(f"{problem}: {spec.model_name} is a built-in test model for task=kv_retrieval; choose "
                              f"a model for task {spec.task} with model=NAME ({', '.join(models)}) or "
                              "model.pretrained=PATH")
        raise ConfigError(f"{problem}: choose a model with a longer context (model=NAME, or {longer}), or {lower}")
