"""lm-eval hooks of LiveCodeBench; prompts, extraction and sandboxed tests live beside them, in livecodebench.py."""

import datasets

from evalkit.benchmark import all_responses, keep_all_samples  # noqa: F401 (the filter named in the YAML)
from evalkit.benchmark.data import DataError, checked_rows, load_rows
from evalkit.tasks.livecodebench import livecodebench as lcb


def dataset_sources(dataset_kwargs):
    """The release's hub files (for the run's identity) when no local path is given."""
    release = dataset_kwargs.get("release")
    if not release:
        return None
    try:
        return lcb.release_sources(release)
    except ValueError as error:
        raise ValueError(f"dataset.release: {error}") from None


def adjust_options(options, apply_chat_template):
    """LiveCodeBench's ``prompt_style`` sets the system turn, the stop strings and whether the chat template wraps
    the prompt (the DeepSeek-R1 style is a raw prompt with R1's own tokens); explicit options win."""
    name = (options.get("dataset") or {}).get("prompt_style") or "generic"
    if name not in lcb.PROMPT_STYLES:
        raise ValueError(f"dataset.prompt_style must be one of {sorted(lcb.PROMPT_STYLES)}, got {name!r}")
    style = lcb.PROMPT_STYLES[name]
    if "system_instruction" not in options and style.system_instruction:
        options["system_instruction"] = style.system_instruction
    generation = options.setdefault("generation", {})
    generation.setdefault("until", list(style.until))
    return apply_chat_template and style.chat_template


def load(release="release_v6", path=None, start_date=None, end_date=None, timeout_s=6, prompt_style="generic",
         memory_mb=None, bad_rows="error", **_options):
    if memory_mb is not None and (isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 1):
        raise DataError(f"task.dataset.memory_mb must be a positive integer or null, got {memory_mb!r}")
    if prompt_style not in lcb.PROMPT_STYLES:
        raise DataError(f"unknown prompt_style {prompt_style!r}; choose one of {sorted(lcb.PROMPT_STYLES)}")
    for name, bound in (("start_date", start_date), ("end_date", end_date)):
        if bound is not None and not lcb.is_date(bound):
            raise DataError(f"task.dataset.{name} must be YYYY-MM-DD, got {bound!r}")
    source = path or lcb.release_sources(release)
    rows = checked_rows(load_rows(source), source, lcb.prepare, bad_rows, id_field="question_id")
    rows = [row for row in rows if lcb.in_window(lcb.contest_datetime(row["contest_date"]), start_date, end_date)]
    if not rows:
        raise DataError(f"no LiveCodeBench problems between {start_date} and {end_date}")
    for row in rows:
        row["id"], row["timeout_s"], row["prompt_style"] = row["question_id"], float(timeout_s), prompt_style
        row["memory_mb"] = memory_mb
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return lcb.prompt(doc)


def process_results(doc, results):
    return lcb.score(doc, all_responses(results), timeout_s=doc["timeout_s"], memory_mb=doc["memory_mb"])
