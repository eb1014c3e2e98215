"""needle_multiturn's dataset options and rows, declared (evalkit.core.schema)."""

from evalkit.core.schema import Key

DATASET = {
    "lengths": Key("ints", "approximate context tokens of the sessions' haystacks (4 characters each)", low=64),
    "needles": Key("int", "needles per haystack, asked one per turn", low=1, high=12),
    "per_length": Key("int", "sessions per length", low=1),
    "seed": Key("int", "the haystacks' and codes' seed", low=0),
}

ROWS = {
    "session_id": Key("text", "the session"),
    "turn": Key("int", "the turn, from 1", low=1),
    "context": Key("text", "the shared haystack"),
    "question": Key("text", "this turn's question"),
    "answer": Key("number_text", "the asked needle's code"),
    "name": Key("text", "the asked needle's name"),
    "length": Key("text", "its length subset"),
    "depth": Key("text", "its depth subset"),
}
