"""A setting or a data field declared once: its kind, range and meaning (:class:`Key`), and the one-line problem of a
value against it. Every config group (:mod:`evalkit.config.run_schema`), every task's dataset options and rows
(``tasks/<folder>/schema.py``) are declared with it, checked before anything loads, and fuzzed from the declarations
(tests/test_schema_fuzz.py). Torch-free."""

from __future__ import annotations

import dataclasses
import json
import math

KINDS = ("int", "float", "bool", "str", "text", "ints", "floats", "strs", "mapping", "number_text", "any")


@dataclasses.dataclass(frozen=True)
class Key:
    """One setting or field. ``kind``: ``int``, ``float`` (any finite number), ``bool``, ``str`` (any text),
    ``text`` (non-empty text), ``ints``/``floats``/``strs`` (a non-empty list of them), ``mapping``,
    ``number_text`` (text that reads as a finite number, or as a JSON list led by one: a numeric answer), ``any``. ``low``/``high``
    bound numbers (each item of a list); ``choices`` the values allowed; ``nullable`` admits null; ``says`` replaces
    the generated description of what is allowed."""

    kind: str
    meaning: str = ""
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None
    nullable: bool = False
    says: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Key kind must be one of {KINDS}, got {self.kind!r}")

    def allowed(self) -> str:
        """What the key takes, as the messages say it (``a positive integer or null``)."""
        if self.says:
            return self.says
        if self.choices is not None:
            text = f"one of {', '.join(map(str, self.choices))}"
        else:
            text = {"int": _integer(self.low, self.high), "float": _number(self.low, self.high),
                    "bool": "true or false", "str": "text", "text": "non-empty text",
                    "ints": f"a non-empty list of {_plural(_integer(self.low, self.high))}",
                    "floats": f"a non-empty list of {_plural(_number(self.low, self.high))}",
                    "strs": "a non-empty list of non-empty texts", "mapping": "a mapping",
                    "number_text": "a finite number (as text)", "any": "any value"}[self.kind]
        return f"{text} or null" if self.nullable else text

    def problem(self, name: str, value) -> str | None:
        """Why ``value`` is not a valid ``name``, in one line, or None."""
        if value is None:
            return None if self.nullable or self.kind == "any" else f"{name} must be {self.allowed()}, got null"
        if not self._fits(value):
            return f"{name} must be {self.allowed()}, got {_shown(value)}"
        return None

    def _fits(self, value) -> bool:
        if self.choices is not None:
            return any(value == c and type(value) is type(c) for c in self.choices)
        kind = self.kind
        if kind in ("ints", "floats", "strs"):
            one = {"ints": "int", "floats": "float", "strs": "text"}[kind]
            item = dataclasses.replace(self, kind=one, nullable=False)
            return isinstance(value, (list, tuple)) and len(value) > 0 and all(item._fits(v) for v in value)
        if kind == "int":
            return _is_int(value) and self._within(value)
        if kind == "float":
            return _is_number(value) and math.isfinite(value) and self._within(value)
        if kind == "bool":
            return isinstance(value, bool)
        if kind == "str":
            return isinstance(value, str)
        if kind == "text":
            return isinstance(value, str) and value.strip() != ""
        if kind == "number_text":
            return isinstance(value, str) and _finite_text(value)
        if kind == "mapping":
            return isinstance(value, dict)
        return True

    def _within(self, value) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)


def check(section: dict, keys: dict[str, Key], prefix: str = "") -> str | None:
    """The first problem of a section's values against its declared ``keys`` (one line), or None. Keys the
    section does not hold are not checked here (defaults come from conf/); unknown keys are the caller's."""
    for name, key in keys.items():
        if name in section:
            found = key.problem(f"{prefix}{name}", section[name])
            if found:
                return found
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_text(text: str) -> bool:
    """Whether ``text`` reads as a finite number (JSON or Python's float), or as a JSON list whose first item is one
    (a numeric answer given as a list)."""
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = float(text.strip())
        except ValueError:
            return False
    if isinstance(value, list) and value:
        value = value[0]
    return _is_number(value) and math.isfinite(value)


def _integer(low, high) -> str:
    if high is not None:
        return f"an integer in [{_n(low)}, {_n(high)}]"
    return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {_n(low)}")


def _number(low, high) -> str:
    if high is not None:
        return f"a number in [{_n(low)}, {_n(high)}]"
    return "a finite number" if low is None else f"a number >= {_n(low)}"


def _plural(text: str) -> str:
    return text.replace("an integer", "integers").replace("a positive integer", "positive integers").replace(
        "a non-negative integer", "non-negative integers").replace("a number", "numbers").replace(
        "a finite number", "finite numbers")


def _n(number) -> str:
    return f"{number:g}" if isinstance(number, float) else str(number)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
