"""needle_multikey's dataset options and rows, declared (evalkit.core.schema)."""

from evalkit.core.schema import Key

DATASET = {
    "lengths": Key("ints", "approximate prompt tokens of the haystacks (4 characters each)", low=64),
    "depths": Key("floats", "where the asked needle sits, 0 (start) to 1 (end)", low=0, high=1),
    "keys": Key("int", "needles hidden in each haystack", low=1),
    "per_cell": Key("int", "prompts per length and depth", low=1),
    "seed": Key("int", "the haystacks' and codes' seed", low=0),
}

ROWS = {
    "id": Key("text", "the prompt's id"),
    "context": Key("text", "the haystack with its needles"),
    "key": Key("text", "the key asked for"),
    "answer": Key("number_text", "its number"),
    "length": Key("text", "its length subset"),
    "depth": Key("text", "its depth subset"),
}
