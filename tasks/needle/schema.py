"""needle's dataset options and rows, declared (evalkit.core.schema): checked before anything loads, and fuzzed."""

from evalkit.core.schema import Key

DATASET = {
    "lengths": Key("ints", "approximate prompt tokens of the haystacks (4 characters each)", low=64),
    "depths": Key("floats", "where the needle sits, 0 (start) to 1 (end)", low=0, high=1),
    "per_cell": Key("int", "prompts per length and depth", low=1),
    "seed": Key("int", "the haystacks' and codes' seed", low=0),
}

ROWS = {
    "id": Key("text", "the prompt's id"),
    "context": Key("text", "the haystack with the needle"),
    "question": Key("text", "the question after it"),
    "answer": Key("number_text", "the six-digit code"),
    "length": Key("text", "its length subset"),
    "depth": Key("text", "its depth subset"),
}
