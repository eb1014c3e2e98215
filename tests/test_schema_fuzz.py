"""Hostile values drawn from the declarations themselves: every declared key of every config group (the run's, the
model's, the task's and each task's dataset options, generation, parallel, logger, every method's settings) and every
task's declared row fields, tried with wrong types, out-of-range and boundary values, empty values, NaN and text,
singly and in pairs. A value out of its declaration is refused in one line that names the key (a ConfigError before
anything loads; a DataError naming the row for data); a value within it is accepted or refused in one line by a rule
between settings; nothing else. A key declared later is tried without a case written for it.

The fast tier draws a bounded number of examples in-process, without a model; the slow tier draws at least 2,000
configurations and rows, and runs the CLI on a sample: a value out of its declaration is one line, exit 2 and nothing
written; a valid one runs (or is refused by a rule in one line)."""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evalkit.benchmark.data import DataError
from evalkit.benchmark.doc_check import checked_docs
from evalkit.benchmark.folder import task_names
from evalkit.config import compose, run_schema
from evalkit.config.method_schema import config_settings, schemas
from evalkit.core.errors import ConfigError
from evalkit.core.schema import Key
from evalkit.run.spec import precheck


# -- what is declared ----------------------------------------------------------------------------------------------
def _method_key(setting) -> Key | None:
    """A method setting's declaration (evalkit.core.method_settings) as a Key, for the kinds the fuzz can draw."""
    kinds = {part.strip() for part in setting.annotation.split("|")}
    nullable = "None" in kinds
    low, high, choices = (setting.bounds.get(k) for k in ("low", "high", "choices"))
    if choices is not None:
        return Key("any", choices=tuple(choices), nullable=nullable)
    if any(kind.startswith("tuple[") for kind in kinds):
        return Key("floats", low=low, high=high, nullable=nullable)
    for kind, name in (("bool", "bool"), ("int", "int"), ("float", "float")):
        if kind in kinds and (kind != "int" or "float" not in kinds):
            return Key(name, low=low, high=high, nullable=nullable) if name != "bool" else Key("bool", nullable=nullable)
    return None


def declared() -> list[tuple[tuple[str, ...], str, Key, str]]:
    """Every declared key: (the overrides that select its group, its dotted name, its declaration, the task the
    config runs)."""
    found = [((), name, key, "kv_retrieval") for name, key in run_schema.RUN.items() if key.kind != "any"]
    found += [((), f"model.{name}", key, "kv_retrieval") for name, key in run_schema.MODEL.items() if key.kind != "any"]
    found += [((), f"memory.{name}", key, "kv_retrieval") for name, key in run_schema.MEMORY.items()]
    # session.*: on a task without sessions (a valid rule other than never is refused by a rule) and on a session
    # task in multi_turn, where it is taken
    for overrides, task in (((), "kv_retrieval"), (("task=agent_loop", "task.mode=multi_turn"), "agent_loop")):
        found += [(overrides, f"session.{name}", key, task) for name, key in run_schema.SESSION.items()]
    found += [(("parallel=ray",), f"parallel.{name}", key, "kv_retrieval") for name, key in run_schema.PARALLEL.items()
              if name != "name"]
    found += [(("logger=wandb",), f"logger.{name}", key, "kv_retrieval") for name, key in run_schema.LOGGER.items()
              if name != "name"]
    for task in task_names():
        found += [((f"task={task}",), f"task.{name}", key, task) for name, key in run_schema.TASK.items()
                  if name not in ("name", "dataset", "generation", "metadata", "source")]
        found += [((f"task={task}",), f"task.dataset.{name}", key, task)
                  for name, key in run_schema.dataset_keys(task).items()]
        found += [((f"task={task}",), f"task.generation.{name}", key, task)
                  for name, key in run_schema.GENERATION.items() if key.kind != "any"]
    for method, method_schema in schemas().items():
        for name in config_settings(method_schema):
            setting = method_schema.settings.get(name) or method_schema.inline.settings[name]
            key = _method_key(setting)
            if key is not None:
                found.append(((f"method={method}", "budget=4x"), f"method.{name}", key, "kv_retrieval"))
    return found


DECLARED = declared()


# -- hostile values ------------------------------------------------------------------------------------------------
def bad_values(key: Key) -> st.SearchStrategy:
    """Values the declaration refuses: wrong types, out of range, empty, NaN, text."""
    wrong = [st.just("abc"), st.just("1.5"), st.just(""), st.just([]), st.just({}), st.just({"a": 1}),
             st.just(float("nan")), st.just(float("inf")), st.just([float("nan")])]
    if not key.nullable and key.kind != "any":
        wrong.append(st.just(None))
    if key.choices is not None:
        return st.one_of(*wrong, st.just("no-such-choice"), st.just(12345)).filter(
            lambda v: not any(v == c and type(v) is type(c) for c in key.choices) and not (v is None and key.nullable))
    kind = key.kind
    if kind in ("int", "float"):
        wrong += [st.just(True), st.just([1, 2])]
        if kind == "int":
            wrong += [st.just(1.5), st.just(2.0)]
        if key.low is not None:
            wrong.append(st.floats(min_value=-1e9, max_value=key.low, exclude_max=True).map(
                lambda v: int(math.floor(v)) if kind == "int" else v).filter(lambda v: v < key.low))
        if key.high is not None:
            wrong.append(st.integers(min_value=int(math.floor(key.high)) + 1, max_value=10**12))
    elif kind in ("ints", "floats"):
        wrong += [st.just(5), st.just("1,2"), st.just([True]), st.just(["a"])]
        if kind == "ints":
            wrong.append(st.just([1.5]))
        if key.low is not None:
            wrong.append(st.just([key.low - 1]))
            wrong.append(st.just([key.low - 100, int(key.low) + 1000]))
        if key.high is not None:
            wrong.append(st.just([key.high + 1]))
    elif kind == "bool":
        wrong += [st.just(0), st.just(1), st.just("true"), st.just("yes")]
    elif kind in ("text",):
        wrong += [st.just(5), st.just("   "), st.just(["a"]), st.just(True)]
    elif kind == "str":
        wrong += [st.just(5), st.just(["a"]), st.just(True)]
    elif kind == "mapping":
        wrong += [st.just(5), st.just("abc"), st.just([1])]
    return st.one_of(*wrong).filter(lambda v: key.problem("x", v) is not None)  # "" is valid for str, say


def good_values(key: Key) -> st.SearchStrategy:
    """Values the declaration admits: its boundaries among them."""
    if key.choices is not None:
        return st.sampled_from(list(key.choices) + ([None] if key.nullable else []))
    low = key.low if key.low is not None else -10
    high = key.high if key.high is not None else low + 4096
    kind = key.kind
    one = {"int": st.integers(min_value=math.ceil(low), max_value=math.floor(high)),
           "float": st.floats(min_value=low, max_value=high, allow_nan=False),
           "bool": st.booleans(), "str": st.text(max_size=8), "text": st.text(min_size=1, max_size=8).filter(str.strip),
           "mapping": st.just({})}
    if kind in ("ints", "floats"):
        item = one["int" if kind == "ints" else "float"]
        values = st.lists(item, min_size=1, max_size=3)
    else:
        values = one.get(kind, st.none())
    bounds = [st.just(v) for v in (key.low, key.high) if v is not None and kind in ("int", "float")]
    return st.one_of(values, *bounds, *([st.none()] if key.nullable else []))


# -- configs -------------------------------------------------------------------------------------------------------
_BASES: dict[tuple, dict] = {}


def base(overrides: tuple[str, ...], task: str) -> dict:
    key = (*overrides, task)
    if key not in _BASES:
        extra = [] if any(o.startswith("task=") for o in overrides) else [f"task={task}"]
        _BASES[key] = compose(*overrides, *extra)
    return _BASES[key]


def with_value(cfg: dict, dotted: str, value) -> dict:
    import copy

    cfg = copy.deepcopy(cfg)
    *parents, leaf = dotted.split(".")
    section = cfg
    for part in parents:
        section = section.setdefault(part, {}) if isinstance(section.get(part), dict) or part not in section else \
            section[part]
        if section is None:
            return cfg
    section[leaf] = value
    return cfg


def explicit(overrides) -> bool:
    return any(o.startswith("method=") for o in overrides)  # as the CLI reads a run without a method: the baseline


def assert_refused(cfg: dict, overrides, *named) -> None:
    """Refused in one line that names the key (or the other key of a pair, where that one is refused first)."""
    try:
        precheck(cfg, method_explicit=explicit(overrides))
    except ConfigError as error:
        line = str(error)
        assert "\n" not in line and line.strip(), line
        assert any(name.rsplit(".", 1)[-1] in line for name in named), f"{named}: {line}"
        return
    pytest.fail(f"{named[0]}={_value(cfg, named[0])!r} is out of its declaration and was accepted")


def _value(cfg: dict, dotted: str):
    for part in dotted.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def assert_answered(cfg: dict, overrides) -> str:
    """A valid value: precheck accepts it ("taken"), or a rule between settings refuses it in one line ("rule")."""
    try:
        precheck(cfg, method_explicit=explicit(overrides))
    except ConfigError as error:
        assert "\n" not in str(error) and str(error).strip()
        return "rule"
    return "taken"


COUNTS: collections.Counter = collections.Counter()  # what the draws came to (the deep pass reports them)


def draw_bad(data) -> tuple[tuple, dict, list[str]]:
    """A config with one declared key out of its declaration, and maybe a second key, valid or not."""
    overrides, name, key, task = data.draw(st.sampled_from(DECLARED))
    value = data.draw(bad_values(key))
    cfg, named = with_value(base(overrides, task), name, value), [name]
    others = [d for d in DECLARED if d[0] == overrides and d[3] == task and d[1] != name]
    if others and data.draw(st.booleans()):  # in a pair: a second key, valid or not
        other_overrides, other, other_key, other_task = data.draw(st.sampled_from(others))
        cfg = with_value(cfg, other, data.draw(st.one_of(good_values(other_key), bad_values(other_key))))
        named.append(other)
    return overrides, cfg, named


def _bad(data):
    overrides, cfg, named = draw_bad(data)
    assert_refused(cfg, overrides, *named)
    COUNTS["config refused"] += 1


def _good(data):
    overrides, name, key, task = data.draw(st.sampled_from(DECLARED))
    cfg = with_value(base(overrides, task), name, data.draw(good_values(key)))
    COUNTS[f"valid config {assert_answered(cfg, overrides)}"] += 1


def fuzz(examples: int):
    """The same draws on every machine and run (a failure reproduces; CI never flakes on a lucky draw)."""
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                    derandomize=True)


def canonical_bad(key: Key) -> list:
    """A value of the wrong kind, and one just out of range where the key has one."""
    wrong = [["a"]] if key.kind not in ("strs",) else [5]
    if key.choices is None and key.kind in ("int", "float", "ints", "floats"):
        item = (lambda v: [v]) if key.kind in ("ints", "floats") else (lambda v: v)
        wrong += [item(key.low - 1)] if key.low is not None else []
        wrong += [item(key.high + 1)] if key.high is not None else []
    return wrong


GROUPS = sorted({(overrides, task) for overrides, _, _, task in DECLARED})


@pytest.mark.parametrize("overrides, task", GROUPS, ids=lambda value: " ".join(value) if isinstance(value, tuple) else value)
def test_every_declared_key_refuses_a_wrong_kind_and_a_value_just_out_of_range(overrides, task):
    """Every key, once each (the draws above sample them): a key declared later is walked without a case for it."""
    for _, name, key, _ in [d for d in DECLARED if (d[0], d[3]) == (overrides, task)]:
        for value in canonical_bad(key):
            assert_refused(with_value(base(overrides, task), name, value), overrides, name)


FAST = 120


@fuzz(FAST)
@given(data=st.data())
def test_a_value_out_of_its_declaration_is_refused_in_one_line_before_anything_loads(data):
    _bad(data)


@fuzz(FAST)
@given(data=st.data())
def test_a_value_within_its_declaration_is_taken_or_refused_by_a_rule_in_one_line(data):
    _good(data)


def test_every_declared_key_is_walked():
    """The walk covers every group: a task's, a method's and the run's keys among them."""
    names = {name for _, name, _, _ in DECLARED}
    assert {"seed", "model.max_context", "task.truncation", "task.dataset.lengths", "task.dataset.n_sessions",
            "task.generation.max_gen_toks", "parallel.replicas", "logger.project", "method.window",
            "session.recompress"} <= names
    assert {task for *_, task in DECLARED} == set(task_names()) | {"kv_retrieval"}


def test_every_session_rule_is_taken_on_a_session_task_and_refused_by_a_rule_elsewhere():
    """session.recompress: each declared value runs a multi_turn session task; a rule other than never on a task
    without sessions is refused in one line that names it (before anything loads)."""
    for rule in run_schema.SESSION["recompress"].choices:
        overrides = ("task=agent_loop", "task.mode=multi_turn", "method=snapkv", "budget=4x")
        assert assert_answered(with_value(base(overrides, "agent_loop"), "session.recompress", rule), overrides) == \
            "taken", rule
        if rule != "never":
            assert_refused(with_value(base((), "kv_retrieval"), "session.recompress", rule), (), "session.recompress")


# -- data rows -----------------------------------------------------------------------------------------------------
def valid_value(key: Key):
    if key.choices is not None:
        return key.choices[0]
    low = key.low if key.low is not None else 1
    return {"int": math.ceil(low), "float": float(low), "bool": True, "str": "x", "text": "x", "ints": [math.ceil(low)],
            "floats": [float(low)], "strs": ["a", "b"], "mapping": {}, "number_text": "42", "any": "x"}[key.kind]


ROW_TASKS = [(task, run_schema.row_keys(task)) for task in task_names()]


def _row(data):
    task, keys = data.draw(st.sampled_from(ROW_TASKS))
    docs = [{name: valid_value(key) for name, key in keys.items()} for _ in range(data.draw(st.integers(2, 5)))]
    position = data.draw(st.integers(0, len(docs) - 1))
    field = data.draw(st.sampled_from(sorted(keys)))
    if data.draw(st.booleans()):
        del docs[position][field]
    else:
        key = keys[field]
        hostile = bad_values(key) if key.kind != "number_text" else st.sampled_from(
            ["", "NaN", "Infinity", "-Infinity", "nan", "abc", "[]", "[NaN]"])
        docs[position][field] = data.draw(hostile)
    with pytest.raises(DataError) as refused:
        checked_docs(docs, keys, "rows.jsonl")
    line = str(refused.value)
    assert "\n" not in line and f"row {position + 1}" in line and repr(field) in line, line
    kept, skipped = checked_docs(docs, keys, "rows.jsonl", bad_rows="skip")
    assert position not in kept and len(kept) == len(docs) - 1 and len(skipped) == 1
    COUNTS["row refused"] += 1


@fuzz(FAST)
@given(data=st.data())
def test_a_row_out_of_its_declaration_is_refused_naming_the_row_or_counted_and_skipped(data):
    _row(data)


def test_valid_rows_of_every_task_pass():
    for task, keys in ROW_TASKS:
        docs = [{name: valid_value(key) for name, key in keys.items()}]
        assert checked_docs(docs, keys, "rows.jsonl") == ([0], []), task


# -- the slow tier: the deep pass, and the CLI on a sample ----------------------------------------------------------
def override(name: str, value) -> str:
    """``value`` as a Hydra command-line override of ``name`` (added where the composed config lacks it)."""

    def text(v):
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if v != v else ("inf" if v > 0 else "-inf")
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(text(item) for item in v) + "]"
        return "{" + ",".join(f"{k}:{text(item)}" for k, item in v.items()) + "}"

    return f"++{name}={text(value)}"


@pytest.mark.slow
def test_the_deep_pass_draws_thousands_of_configurations_and_rows():
    COUNTS.clear()
    for run, examples in ((_bad, 1100), (_good, 600), (_row, 600)):
        fuzz(examples)(given(data=st.data())(run))()
    total = sum(COUNTS.values())
    print(f"schema fuzz, deep pass: {dict(COUNTS)}; {total} in all")
    assert total >= 2000 and COUNTS["valid config taken"] > COUNTS["valid config rule"] / 4, dict(COUNTS)


@pytest.mark.slow
@fuzz(40)
@given(data=st.data())
def test_the_cli_refuses_a_drawn_config_in_one_line_with_exit_2_and_writes_nothing(tmp_path_factory, data):
    from tests.helpers import evalkit

    overrides, name, key, task = data.draw(st.sampled_from(DECLARED))
    value = data.draw(bad_values(key))
    folder = tmp_path_factory.mktemp("cli")
    results = folder / "results"
    task_override = [] if any(o.startswith("task=") for o in overrides) else [f"task={task}"]
    result = evalkit(*overrides, *task_override, override(name, value), f"results_dir={results}", cwd=folder)
    lines = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not results.exists() and not list(folder.glob("*results*")), sorted(folder.rglob("*"))


@pytest.mark.slow
@fuzz(15)
@given(data=st.data())
def test_the_cli_runs_a_drawn_valid_config_or_refuses_it_by_a_rule_in_one_line(tmp_path_factory, data):
    from tests.helpers import evalkit

    runnable = [d for d in DECLARED if d[3] == "kv_retrieval" and not d[1].startswith(("parallel.", "logger.", "device"))
                and d[1] not in ("results_dir", "model.pretrained", "model.name", "model.dtype")]
    overrides, name, key, _ = data.draw(st.sampled_from(runnable))
    value = data.draw(good_values(key))
    folder = tmp_path_factory.mktemp("cli")
    result = evalkit(*overrides, "task=kv_retrieval", "limit=2", "task.truncation=left", override(name, value),
                     f"results_dir={folder / 'results'}", cwd=folder)
    lines = [line for line in result.stderr.splitlines() if line.startswith("evalkit:") and "warning" not in line]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0 or (result.returncode == 2 and len(lines) == 1), result.stderr[-2000:]
