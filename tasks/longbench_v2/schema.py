"""LongBench-v2's dataset options and rows, declared (evalkit.core.schema)."""

from evalkit.core.schema import Key

DATASET = {
    "path": Key("text", "hub id or a local .json/.jsonl/.parquet file"),
    "cot": Key("bool", "the official two-call chain of thought"),
    "empty_output": Key("str", "skip: an empty output leaves the denominator (official) | zero: scored wrong",
                        choices=("skip", "zero")),
    "reasoning_max_gen_toks": Key("int", "tokens of the reasoning call", low=1),
}

ROWS = {
    "id": Key("text", "the item's _id"),
    "question": Key("text", "the question"),
    "choice_A": Key("str", "choice A"),
    "choice_B": Key("str", "choice B"),
    "choice_C": Key("str", "choice C"),
    "choice_D": Key("str", "choice D"),
    "answer": Key("str", "the gold choice", choices=("A", "B", "C", "D")),
    "context": Key("text", "the document"),
    "difficulty": Key("text", "easy or hard"),
    "length": Key("text", "short, medium or long"),
}
