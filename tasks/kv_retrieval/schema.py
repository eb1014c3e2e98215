"""kv_retrieval's dataset options and rows, declared (evalkit.core.schema)."""

from evalkit.core.schema import Key

DATASET = {
    "n_samples": Key("int", "prompts", low=1),
    "seed": Key("int", "the prompts' seed", low=0),
    "min_pairs": Key("int", "fewest key-value pairs a prompt", low=1, high=256),
    "max_pairs": Key("int", "most key-value pairs a prompt (>= min_pairs)", low=1, high=256),
}

ROWS = {
    "id": Key("text", "the prompt's id"),
    "context": Key("text", "the key-value pairs"),
    "question": Key("text", "the key asked for"),
    "answer": Key("text", "its value"),
    "n_pairs": Key("int", "pairs in the prompt", low=1),
    "needle_index": Key("int", "where the asked pair is", low=0),
    "depth": Key("float", "its depth", low=0, high=1),
    "depth_bucket": Key("text", "its depth subset"),
}
