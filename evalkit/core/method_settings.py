"""A method's settings, declared once: each is a dataclass field made by :func:`setting`, its type the field's
annotation, its bounds in the field's metadata. The method checks them when it is built (:func:`check`) and a config
is checked against the same declarations before torch loads (:mod:`evalkit.config.method_schema` reads them from the
source). Torch-free."""

from __future__ import annotations

import dataclasses
import math


def setting(default=dataclasses.MISSING, *, low=None, high=None, choices=None, odd=False,
            recorded_when_set=False) -> dataclasses.Field:
    """A dataclass field with its bounds: ``low``/``high`` (numbers, or each number of a ``tuple[float, ...]``),
    ``choices`` (a tuple), ``odd`` (integers).
    ``recorded_when_set``: a setting added after runs were recorded, left out of the tables while at its default so
    that those runs keep their config digest."""
    bounds = {"low": low, "high": high, "choices": choices, "odd": odd, "recorded_when_set": recorded_when_set}
    return dataclasses.field(default=default, metadata={k: v for k, v in bounds.items() if v is not None and v is not False})


def problem(owner: str, name: str, value, annotation: str, bounds: dict) -> str | None:
    """Why ``value`` is not a valid ``owner.name`` (declared ``annotation`` and ``bounds``), or None."""
    kinds = {part.strip() for part in annotation.split("|")}
    if value is None:
        return None if "None" in kinds else f"{owner}.{name} must be set, got None"
    low, high, choices = bounds.get("low"), bounds.get("high"), bounds.get("choices")
    allowed = "" if low is None else f" >= {low}" if high is None else f" in [{low}, {high}]"
    if any(kind.startswith("tuple[") for kind in kinds):  # a list of numbers, each within the bounds
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (low is None or v >= low)
                and (high is None or v <= high) for v in value):
            return None
        return f"{owner}.{name} must be a list of numbers{allowed}, got {value!r}"
    if "bool" in kinds:
        return None if isinstance(value, bool) else f"{owner}.{name} must be true or false, got {value!r}"
    if "int" in kinds or "float" in kinds:
        number = (int,) if "float" not in kinds else (int, float)
        if isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value) or (
                low is not None and value < low) or (high is not None and value > high):
            kind = "an integer" if "float" not in kinds else "a number"
            return f"{owner}.{name} must be {kind}{allowed}, got {value!r}"
        if bounds.get("odd") and value % 2 == 0:
            # Even kernels with padding k//2 change the length of the pooled scores; the reference code uses odd ones.
            return f"{owner}.{name} must be odd, got {value}"
        return None
    if choices is not None and value not in choices:
        return f"{owner}.{name} must be one of {list(choices)}, got {value!r}"
    return None


def annotation(field: dataclasses.Field) -> str:
    """A field's annotation as its source writes it (``int | None``), whether or not its module postpones them."""
    return field.type if isinstance(field.type, str) else getattr(field.type, "__name__", None) or str(field.type)


def check_value(cls, name: str, value) -> None:
    """Raise a ValueError if ``value`` is out of the declared bounds of ``cls``'s setting ``name`` (before building
    ``cls``: a value a method computes with first)."""
    field = next(field for field in dataclasses.fields(cls) if field.name == name)
    error = problem(cls.__name__, name, value, annotation(field), dict(field.metadata))
    if error:
        raise ValueError(error)


def check(instance) -> None:
    """Raise a ValueError naming the first declared setting of ``instance`` out of its bounds."""
    owner = type(instance).__name__
    for field in dataclasses.fields(instance):
        kinds = {part.strip() for part in annotation(field).split("|")}
        if "low" in field.metadata or "choices" in field.metadata or kinds & {"int", "bool", "float"}:
            error = problem(owner, field.name, getattr(instance, field.name), annotation(field), dict(field.metadata))
            if error:
                raise ValueError(error)
