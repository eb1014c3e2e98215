"""The SCBench tasks' dataset options and rows (one doc per turn of a session), declared (evalkit.core.schema)."""

from evalkit.core.schema import Key

DATASET = {
    "source": Key("str", "auto | generated | hub | file", choices=("auto", "generated", "hub", "file")),
    "path": Key("text", "a .jsonl/.json/.parquet file of rows in the hub's schema", nullable=True),
    "revision": Key("text", "of microsoft/SCBench", nullable=True),
    "lengths": Key("ints", "generated sessions' approximate context tokens (4 characters each)", low=64),
    "n_sessions": Key("int", "generated sessions per length", low=1),
    "turns": Key("int", "queries per session (file and hub rows: their first turns)", low=1),
    "seed": Key("int", "the generated sessions' seed", low=0),
}

_DOC = {
    "session_id": Key("text", "the session (the row's id)"),
    "turn": Key("int", "the turn, from 1", low=1),
    "context": Key("str", "the shared context"),
    "input": Key("str", "this turn's query"),
    "answer": Key("text", "the gold answer (an empty one would score an empty prediction 1.0)"),
    "target": Key("text", "the gold answer as the scorer reads it"),
}


def ROWS(task: str) -> dict:  # noqa: N802 (read as the task's declared rows, like the other tasks' ROWS)
    """The fields of a doc of ``task`` (scbench_mf's answers are numbers)."""
    if task == "scbench_mf":
        return {**_DOC, "target": Key("number_text", "the gold number (finite; a list's first item)")}
    if task == "scbench_choice_eng":
        return {**_DOC, "options": Key("strs", "the four choices")}
    return _DOC
