"""agent_loop's dataset options and rows, declared (evalkit.core.schema)."""

from evalkit.core.schema import Key

DATASET = {
    "path": Key("text", "a .jsonl file of calls (session_id, turn, content, question, answer); null: generated",
                nullable=True),
    "calls": Key("int", "calls per generated session", low=1, high=12),
    "n_sessions": Key("int", "generated sessions", low=1),
    "doc_tokens": Key("int", "approximate tokens of each call's document (4 characters each)", low=32),
    "variant": Key("str", "recall (a fact of a call so far) | first_latest (the first document's and the latest's)",
                   choices=("recall", "first_latest")),
    "seed": Key("int", "the generated sessions' seed", low=0),
}

ROWS = {
    "session_id": Key("text", "the session"),
    "turn": Key("int", "the call, from 1", low=1),
    "context": Key("text", "the shared context: the preamble and the first call's document"),
    "between": Key("str", "the documents of the calls between the first and this one"),
    "content": Key("text", "this call's document (its tool output)"),
    "question": Key("text", "this call's question"),
    "answer": Key("number_text", "the code asked for"),
    "asked": Key("int", "the call whose planted fact the question names", low=1),
}
