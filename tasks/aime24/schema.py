"""The dataset options and rows of aime24 and of the tasks built on it (aime25, math500), declared
(evalkit.core.schema)."""

from evalkit.core.schema import Key

DATASET = {
    "path": Key("text", "hub id or a local .json/.jsonl/.parquet file"),
    "split": Key("text", "the hub dataset's split", nullable=True),
    "prompt_style": Key("str", "r1: R1's directive | lighteval: aime_prompt_fn", choices=("r1", "lighteval")),
    "extraction": Key("str", "how the answer is read", choices=("open_r1", "lighteval", "r1_final_box")),
}

ROWS = {
    "id": Key("text", "the problem's id"),
    "problem": Key("text", "the problem"),
    "answer": Key("text", "the gold answer"),
}
