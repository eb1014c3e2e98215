"""The torch-free method schema (evalkit/config/method_schema.py) is the methods' own declarations: every registered method
with the same settings, types, defaults and bounds as its class, and the same one-line message for each bad value;
the CLI answers a bad method value with it before torch loads, composing the config and checking it once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import evalkit.compression as ec
from evalkit.config.method_schema import config_settings, schemas
from evalkit.core.method_settings import annotation


def test_every_registered_method_has_a_schema():
    assert sorted(schemas()) == sorted(ec.POLICIES)


@pytest.mark.parametrize("name", sorted(ec.POLICIES))
def test_the_schema_declares_what_the_class_declares(name):
    cls, schema = ec.POLICIES[name], schemas()[name]
    assert schema.class_name == cls.__name__
    assert schema.takes_budget == cls.takes_budget
    assert config_settings(schema) == cls.config_settings()
    own = [field for field in dataclasses.fields(cls) if field.name not in cls.budget_fields]
    assert list(schema.settings) == [field.name for field in own]
    for field in own:
        declared = schema.settings[field.name]
        assert (declared.annotation, declared.default, declared.bounds) == (
            annotation(field), field.default, dict(field.metadata)), field.name


def bad_values(setting):
    """One value of each kind the declaration rules out."""
    kinds = {part.strip() for part in setting.annotation.split("|")}
    bounds = setting.bounds
    if any(kind.startswith("tuple[") for kind in kinds):  # a list of numbers
        return ["3", [], [1, "x"], *([[bounds["low"] - 1]] if "low" in bounds else [])]
    if "bool" in kinds:
        return ["yes", 1]
    if kinds & {"int", "float"}:
        values = ["3", True]
        if "low" in bounds:
            values.append(bounds["low"] - (0.5 if "float" in kinds else 1))
        if "high" in bounds:
            values.append(bounds["high"] + 1)
        if bounds.get("odd"):
            values.append(bounds.get("low", 0) + bounds.get("low", 0) % 2)  # the first even value in bounds
        return values
    return ["nosuch"] if "choices" in bounds else []


CASES = [(name, key, value) for name, schema in sorted(schemas().items())
         for key in config_settings(schema)
         for value in bad_values(schema.settings.get(key) or schema.inline.settings[key])]


def test_there_are_bad_values_for_every_kind_of_bound():
    assert len(CASES) > 40
    assert {key for _, key, _ in CASES} >= {"window", "kernel_size", "pooling", "use_vnorm", "alpha_safeguard"}


@pytest.mark.parametrize("name, key, value", CASES)
def test_the_schema_refuses_what_the_method_refuses_in_its_words(name, key, value):
    with pytest.raises(ValueError) as refused:
        ec.policy_from_budget(name, "tokens_4096" if ec.POLICIES[name].takes_budget else None, 8192, **{key: value})
    assert schemas()[name].problem({key: value}) == str(refused.value)


@pytest.mark.parametrize("name", sorted(ec.POLICIES))
def test_the_schema_passes_the_shipped_method_configs(name):
    from yaml import safe_load

    from evalkit.core.paths import conf_dir

    written = safe_load((conf_dir() / "method" / f"{name}.yaml").read_text())
    settings = {key: value for key, value in written.items() if key != "name"}
    assert set(settings) <= set(config_settings(schemas()[name]))
    assert schemas()[name].problem(settings) is None


@pytest.mark.parametrize("args, message", [
    (["method=snapkv", "method.window=-3", "task=needle"], "SnapKV.window must be an integer >= 1, got -3"),
    (["+budget=4x", "method.kernel_size=4", "task=needle"], "SnapStream.kernel_size must be odd, got 4"),
    (["+budget=4x", "method=adakv", "method.pooling=sum"], "AdaKV.pooling must be one of ['max', 'avg'], got 'sum'"),
    (["+budget=4x", "method=simlayerkv"],
     "method=simlayerkv sizes its cache by its own settings and takes no budget; drop +budget"),
    (["+budget=4x", "method=knorm", "+method.windw=3"], "unknown setting method.windw: did you mean method.window?"),
    (["+budget=4x", "method=per_layer", "method.weights=[1,-1]"],
     "PerLayer.weights must be a list of numbers >= 0, got [1, -1]"),
])
def test_a_bad_method_value_is_one_line_before_torch_loads(tmp_path, args, message):
    driver = ("import sys\nfrom evalkit.cli import main\nsys.argv[1:] = sys.argv[2:]\n"
              "try:\n    main()\nfinally:\n    print('torch loaded' if 'torch' in sys.modules else 'no torch')\n")
    result = subprocess.run([sys.executable, "-c", driver, "evalkit", *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"evalkit: config error: {message}"]
    assert result.stdout.strip() == "no torch"


def test_a_run_composes_its_config_and_prechecks_it_once(tmp_path, monkeypatch, random_model_dir):
    """Refused in validation, after torch loads (a decode-time method under chunked compression): by then the config
    was composed once and prechecked once."""
    import hydra

    import evalkit.cli as cli
    import evalkit.run.spec as spec

    calls = {"compose": 0, "precheck": 0}

    def counting(name, function):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(hydra, "compose", counting("compose", hydra.compose))
    precheck = counting("precheck", spec.precheck)
    monkeypatch.setattr(spec, "precheck", precheck)
    monkeypatch.setattr(cli, "precheck", precheck)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["evalkit", "+budget=4x", "method=h2o", "prefill_chunk=8",
                                      "prefill_chunk_mode=compress", f"model.pretrained={random_model_dir}"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 2
    assert calls == {"compose": 1, "precheck": 1}
