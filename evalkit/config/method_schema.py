"""Every method's settings as its file in evalkit/compression/methods/ declares them (names, types, bounds, defaults:
:func:`evalkit.core.method_settings.setting`), read from the source without importing it (the methods import torch): a
config's method values are checked in a moment, with the messages the methods themselves give. Tests hold it equal
to the classes' own fields."""

from __future__ import annotations

import ast
import dataclasses
from functools import cache
from pathlib import Path

from evalkit.core.method_settings import problem, setting

METHODS = Path(__file__).parents[1] / "compression" / "methods"


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    annotation: str
    default: object  # dataclasses.MISSING when the budget or the caller must give it
    bounds: dict


@dataclasses.dataclass(frozen=True)
class MethodSchema:
    name: str
    class_name: str
    settings: dict[str, Setting]  # what a config may give, in the class's field order
    inline: MethodSchema | None  # a wrapper's own method, whose settings a config gives the wrapper flat
    takes_budget: bool = True  # False: the method sizes the cache itself (full, simlayerkv, duo_attention)

    def problem(self, values: dict) -> str | None:
        """The first value in ``values`` (a method config's settings) out of its declared bounds, as the method says
        it, or None. Checks what needs no budget: cross-setting rules wait for the method itself."""
        for key, value in values.items():
            own = self.settings.get(key)
            if own is None and self.inline is not None and key in self.inline.settings:
                own = self.inline.settings[key]
            if own is not None:  # null too: a setting that is not nullable has no "unset" (its default is conf's)
                error = problem(self.class_name, key, value, own.annotation, own.bounds)
                if error:
                    return error
        return None


@dataclasses.dataclass
class _Class:
    name: str
    bases: list[str]
    classvars: dict[str, object]
    fields: dict[str, Setting]
    registers: bool


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return dataclasses.MISSING  # not a literal (a factory, a name): unknown here


def _field(target: str, annotation: str, value: ast.AST | None) -> Setting:
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "setting":
        default = _literal(value.args[0]) if value.args else dataclasses.MISSING
        declared = setting(**{kw.arg: _literal(kw.value) for kw in value.keywords})  # its metadata, as the class's
        return Setting(target, annotation, default, dict(declared.metadata))
    return Setting(target, annotation, dataclasses.MISSING if value is None else _literal(value), {})


def _classes(source: str) -> list[_Class]:
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        classvars, fields = {}, {}
        for item in node.body:
            if not isinstance(item, ast.AnnAssign) or not isinstance(item.target, ast.Name):
                continue
            annotation = ast.unparse(item.annotation)
            if annotation.startswith("ClassVar"):
                classvars[item.target.id] = None if item.value is None else _literal(item.value)
            else:
                fields[item.target.id] = _field(item.target.id, annotation, item.value)
        registers = all(not (kw.arg == "register" and _literal(kw.value) is False) for kw in node.keywords)
        found.append(_Class(node.name, [ast.unparse(base) for base in node.bases], classvars, fields, registers))
    return found


@cache
def schemas(folder: str = str(METHODS)) -> dict[str, MethodSchema]:
    """Every registered method's schema by name, read from the method files in ``folder``."""
    classes = {c.name: c for path in sorted(Path(folder).glob("*.py")) for c in _classes(path.read_text())}

    def lineage(name: str) -> list[_Class]:  # the class and its bases known here, the base first (dataclass order)
        cls = classes.get(name)
        if cls is None:
            return []
        chain = [ancestor for base in reversed(cls.bases) for ancestor in lineage(base)]
        return [*chain, cls]

    def resolved(name: str) -> tuple[dict[str, Setting], dict[str, object]]:
        fields, classvars = {}, {}
        for ancestor in lineage(name):
            for key, value in ancestor.fields.items():
                fields[key] = value  # an override keeps the first declaration's place, as dataclasses does
            classvars.update(ancestor.classvars)
        return fields, classvars

    def is_policy(name: str) -> bool:
        return any(ancestor.name == "Policy" for ancestor in lineage(name)[:-1])

    by_name: dict[str, MethodSchema] = {}

    def build(class_name: str) -> MethodSchema:
        fields, classvars = resolved(class_name)
        budget = classvars.get("budget_fields") or ()
        inline = classvars.get("inline")
        inline_schema = None
        if inline:
            inline_schema = next(build(c.name) for c in classes.values()
                                 if c.registers and c.classvars.get("name") == inline[0] and is_policy(c.name))
        settings = {key: value for key, value in fields.items() if key not in budget}
        return MethodSchema(classvars["name"], class_name, settings, inline_schema,
                            classvars.get("takes_budget", True) is not False)

    for cls in classes.values():
        if cls.registers and "name" in cls.classvars and is_policy(cls.name):
            by_name[cls.classvars["name"]] = build(cls.name)
    return by_name


def config_settings(schema: MethodSchema) -> tuple[str, ...]:
    """The settings a config may give the method: its own, and a wrapper's inline method's."""
    inline = () if schema.inline is None else tuple(k for k in schema.inline.settings if k not in schema.settings)
    return (*schema.settings, *inline)
