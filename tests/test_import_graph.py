"""evalkit's import graph, as docs/architecture.md draws it: its parts (the top-level modules and
packages of evalkit/) import only parts below them in LAYERS, so the graph has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "evalkit"
# Top first: each part may import the parts after it, never one before it.
LAYERS = ["cli", "sweep_progress", "lm_eval_plugin", "train_tiny", "config", "run", "lm", "lm_requests", "request_cost", "parallel",
          "measure",
          "memory", "results", "models", "gguf_models", "prompts", "progress", "task", "tasks", "scoring", "sandbox", "synthetic", "method_config",
          "compression", "method_schema", "method_settings", "identity", "attention_shape", "budget", "console", "errors", "paths",
          "assets"]


def part_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "evalkit" and len(parts) > 1 else None


def imports() -> dict[str, set[str]]:
    """Each part's imports of other parts (lazy imports inside functions included)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                root = ".".join([*base, *([node.module] if node.module else [])])
                targets = [f"{root}.{alias.name}" for alias in node.names] if root == "evalkit" else [root]
            else:
                continue
            source = part_of(module)
            for target in map(part_of, targets):
                if source and target and target != source:
                    found.setdefault(source, set()).add(target)
    return found


def test_every_part_of_evalkit_has_its_layer():
    parts = {path.stem for path in PACKAGE.iterdir() if path.suffix == ".py" or (path / "__init__.py").exists()}
    assert parts - {"__init__"} <= set(LAYERS), sorted(parts - {"__init__"} - set(LAYERS))


def test_no_part_imports_one_above_it():
    upward = [(source, target) for source, targets in imports().items() for target in targets
              if LAYERS.index(target) < LAYERS.index(source)]
    assert upward == []


def test_no_module_class_or_function_outgrows_its_limit():
    """Small parts: no module of evalkit/ over 450 lines, no class over 250, no function over 60."""
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if len(text.splitlines()) > 450:
            too_big.append(f"module {name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            limit = 250 if isinstance(node, ast.ClassDef) else 60 if isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if limit and node.end_lineno - node.lineno + 1 > limit:
                too_big.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big
