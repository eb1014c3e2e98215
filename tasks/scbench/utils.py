"""lm-eval hooks of the SCBench tasks (``tasks/scbench/scbench_<name>.yaml``); the port itself lives beside them, in
scbench.py (rows, docs, prompts), scoring.py and generators.py. Each doc is one turn of one session (``session_id``,
``turn`` from 1)."""

import datasets

from evalkit.tasks.scbench import generators, scbench, scoring
from evalkit.tasks.scbench.generated_docs import GeneratedDocs


def load(task, source="auto", path=None, revision=None, lengths=(1024,), n_sessions=10, turns=5, seed=1234,
         bad_rows="error", **_metadata):
    """The docs of ``scbench_<task>``: one per turn of each session. ``source``: generated (evalkit's generator, for
    kv, prefix_suffix, vt, mf: ``n_sessions`` per length of ``lengths`` approximate context tokens, ``turns`` queries
    each, from ``seed``) | hub (microsoft/SCBench at ``revision``) | file (``path``: .jsonl/.json/.parquet rows in the
    hub's schema) | auto (file with a path, generated for the synthetic tasks, else hub). Hub and file rows are cut to
    their first ``turns`` turns as run_scbench.py's ``--max_turns`` does. ``bad_rows=skip`` leaves bad rows out
    (generated rows have none). Generated docs are made as they are read (:class:`GeneratedDocs`)."""
    kind = scbench.resolve_source(task, source, path)
    if kind == "generated":  # made as lm-eval reads them: a limit generates only the sessions it asks
        return {"test": GeneratedDocs(task, list(lengths), int(n_sessions), int(turns), int(seed))}
    if kind == "file":
        rows, where = scbench.read_file(path), str(path)
    else:
        rows, where = scbench.load_hub(task, revision), f"{scbench.HUB_ID} (scbench_{task})"
    if bad_rows == "skip":
        rows = _kept_rows(rows, task, where)
    docs = scbench.rows_to_docs(rows, task, int(turns), where)
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def _kept_rows(rows, task, where):
    """The rows scbench.check_row accepts; the others go to the run's list of skipped rows, one line each."""
    from evalkit.benchmark import data

    def check(row):
        try:
            return scbench.check_row(row, task)
        except scbench.RowError as error:
            raise data.RowError(error.field, error.problem) from None

    return data.checked_rows(rows, where, check, bad_rows="skip")


def doc_to_text(doc):
    """The single request (SCBench's multi-request format): the first-turn template over the session's context, then
    this doc's query."""
    return scbench.context_part(doc) + doc_to_question(doc)


def doc_to_question(doc):
    """What follows the context in :func:`doc_to_text` (``\\n\\n`` and the query): where the shared context ends."""
    return scbench.question(doc)


def doc_to_follow_up(doc):
    """The user text SCBench sends for this doc's query at turn >= 2 of a chat."""
    return scbench.follow_up(doc)


def doc_to_follow_up_prefix(doc):
    """What SCBench's chat follow-up forces at the start of the assistant's answer (summary: "This paper"; else "")."""
    return scbench.follow_up_prefix(doc)


def doc_to_follow_up_plain(doc):
    """Without a chat template: the text SCBench sends after the previous turn's gold answer (no template markup)."""
    return scbench.follow_up_plain(doc)


def doc_to_history(doc):
    """The gold answer SCBench appends as the assistant's turn (``str(answer)``: a list as its Python repr)."""
    return doc["answer"]


def process_results(doc, results):
    """The turn's official score; a RepoQA prediction from :func:`repoqa_candidates` brings its candidates."""
    prediction = results[0]
    needles = getattr(prediction, "needles", None)
    return {scbench.METRICS[doc["scbench_task"]]: scoring.score(doc, str(prediction), needles)}


class PooledPrediction(str):
    """A RepoQA prediction (its text) with ``needles``, the candidates its best match is picked from."""

    def __new__(cls, text: str, needles: list[dict]):
        prediction = super().__new__(cls, text)
        prediction.needles = needles
        return prediction

    def __reduce__(self):
        return PooledPrediction, (str(self), self.needles)


def repoqa_candidates(resps, docs):
    """lm-eval filter of the RepoQA tasks (their ``filter_list``): each doc's first response (lm-eval's default
    filter) with compute_scores' ``needle_by_repo`` over the docs evaluated, which are all this filter sees (lm-eval's
    ``limit`` applied), as the official pool is built from the prediction file of the examples run."""
    pools = scbench.needle_pools(docs)
    return [PooledPrediction(responses[0], pools.get(doc["repo"], [])) for responses, doc in zip(resps, docs)]


def _source(dataset_kwargs):
    try:
        return scbench.resolve_source(dataset_kwargs.get("task"), dataset_kwargs.get("source", "auto"),
                                      dataset_kwargs.get("path"))
    except ValueError as error:  # the run reports it as task.<message>
        raise ValueError(str(error).removeprefix("task.")) from None


def dataset_sources(dataset_kwargs):
    """microsoft/SCBench for hub data; None for generated data (and a file names itself)."""
    return scbench.HUB_ID if _source(dataset_kwargs) == "hub" else None


def dataset_identity(dataset_kwargs):
    """Generated data: the generator's version (its options are the run's own)."""
    return f"evalkit-scbench-generator-v{generators.GENERATOR_VERSION}:{dataset_kwargs.get('task')}"
