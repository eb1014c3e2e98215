"""LiveCodeBench's dataset options and rows, declared (evalkit.core.schema)."""

from evalkit.core.schema import Key

DATASET = {
    "release": Key("text", "release_v1 .. release_v6, read from the hub", nullable=True),
    "path": Key("text", "local JSONL file(s) in the hub schema", nullable=True),
    "start_date": Key("text", "contest_date window start, YYYY-MM-DD", nullable=True),
    "end_date": Key("text", "contest_date window end, YYYY-MM-DD", nullable=True),
    "timeout_s": Key("float", "seconds per test", low=0.001),
    "prompt_style": Key("str", "generic | deepseek_r1", choices=("generic", "deepseek_r1")),
    "memory_mb": Key("int", "address-space cap per program", low=1, nullable=True),
}

ROWS = {
    "question_id": Key("text", "the problem's id"),
    "question_title": Key("str", "its title"),
    "question_content": Key("text", "the problem"),
    "platform": Key("text", "where it is from"),
    "contest_date": Key("text", "when"),
    "starter_code": Key("str", "the code it starts from"),
    "tests": Key("text", "its tests (JSON)"),
}
