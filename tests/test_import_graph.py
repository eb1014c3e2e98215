"""evalkit's import graph, as docs/architecture.md draws it: the top level holds ``cli.py``, ``__init__.py`` and at most
ten packages, each importing only the packages below it in LAYERS; no modules import each other, directly or around a
circle; no module, class or function outgrows its bound; and a module of the earlier layout names where it went."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "evalkit"
# Top first: each part may import the parts after it, never one before it.
LAYERS = ["cli", "run", "lm", "config", "memory", "results", "models", "benchmark", "tasks", "compression", "core"]
# Bounds in lines: any module; the lm-eval adapter's model and the runner, which tend to collect everything.
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 450, 250, 60
SPECIAL_BOUNDS = {"lm/model.py": 200, "run/runner.py": 300}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """The evalkit modules ``path`` imports (lazy imports inside functions included): ``from a import b`` names the
    module ``a.b`` where ``b`` is one, ``a`` otherwise."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            root = ".".join([*base, *([node.module] if node.module else [])])
            targets = [f"{root}.{alias.name}" if f"{root}.{alias.name}" in MODULES else root for alias in node.names]
        else:
            continue
        found |= {target for target in targets if target.split(".")[0] == "evalkit" and target != module}
    return found


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_top_level_holds_cli_init_and_at_most_ten_packages_each_saying_what_it_is_for():
    loose = sorted(path.name for path in PACKAGE.glob("*.py") if path.name not in ("cli.py", "__init__.py"))
    packages = sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists())
    assert loose == [], loose
    assert len(packages) <= 10, packages
    assert set(packages) | {"cli"} == set(LAYERS), sorted(set(packages) ^ set(LAYERS) - {"cli"})
    for name in packages:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc and doc.split("\n\n")[0].strip().endswith("."), f"evalkit/{name}/__init__.py says not what it is for"


def test_no_part_imports_one_above_it():
    upward = sorted({(part_of(module), part_of(target)) for module, path in MODULES.items()
                     for target in imported_modules(path)
                     if part_of(target) in LAYERS and part_of(module) in LAYERS
                     and LAYERS.index(part_of(target)) < LAYERS.index(part_of(module))})
    assert upward == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other_directly_or_around_a_circle():
    graph = {module: imported_modules(path) & set(MODULES) for module, path in MODULES.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_class_or_function_outgrows_its_bound():
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE).as_posix()
        lines = len(text.splitlines())
        if lines > SPECIAL_BOUNDS.get(name, MODULE_LINES):
            too_big.append(f"module evalkit/{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            limit = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES if isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if limit and node.end_lineno - node.lineno + 1 > limit:
                too_big.append(f"evalkit/{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big


@pytest.mark.parametrize("old", ["evalkit.errors", "evalkit.method_config", "evalkit.sandbox", "evalkit.task.folder",
                                 "evalkit.scoring", "evalkit.scoring.data", "evalkit.lm_eval_plugin", "evalkit.synthetic"])
def test_a_module_of_the_earlier_layout_is_the_same_module_under_its_new_name_with_a_warning(old):
    """For one release an earlier name gives the very module, not a copy with classes of its own, and says where it
    is now, at the line that imported it."""
    import sys

    import evalkit

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is now {evalkit.moved_to(old)}: import it from there") as said:
        assert importlib.import_module(old) is importlib.import_module(evalkit.moved_to(old))
    assert {Path(warning.filename).name for warning in said} == {Path(__file__).name}


def test_no_module_of_evalkit_or_of_a_task_imports_an_earlier_name():
    import evalkit

    tasks = PACKAGE.parent / "tasks"
    earlier = [f"{path.relative_to(PACKAGE.parent)}: {name}" for path in [*PACKAGE.rglob("*.py"), *tasks.rglob("*.py")]
               if path != PACKAGE / "__init__.py" for name in imported_names(path) if evalkit.moved_to(name)]
    assert earlier == []


def imported_names(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def test_load_model_imports_from_evalkit_lm_as_before_with_a_warning_naming_its_place():
    with pytest.warns(DeprecationWarning, match="evalkit.lm.load_model is now evalkit.models.load_model"):
        from evalkit.lm import load_model
    from evalkit.models import load_model as now

    assert load_model is now


def test_the_entry_points_users_import_still_work():
    from evalkit.benchmark import sandbox
    from evalkit.config import compose  # noqa: F401
    from evalkit.lm import EvalkitLM
    from evalkit.memory import kv_bytes_per_token  # noqa: F401

    assert EvalkitLM.__module__ == "evalkit.lm.model"
    assert sandbox.__name__ == "evalkit.benchmark.sandbox"


def test_docs_architecture_names_every_package_in_its_layer():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = [line.split("|")[1].strip(" `") for line in doc.splitlines() if line.startswith("| `")]
    assert rows == ["cli.py", *[f"{name}/" for name in LAYERS[1:]]]
