"""Learned-weight files (DuoAttention patterns, KVzap surrogates, Q-Filters, Fast-KVzip gates, LU-KV curves) that are
damaged, or whose values cannot mean what their format says, are refused with one line naming the file and what is
wrong: as the method is built (what the file says alone, before any model loads), at ``check_layers`` (its layers
against the model's) or at the first prompt's prefill (its heads and widths against the model's). The CLI prints
that line, exits 2 and writes nothing. Most cases build the method in-process; a few run the CLI end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import evalkit
from learned_files import copy_of, duo_pattern, fastkvzip_gates, kvzap, lukv_curve, qfilters
from safetensors.torch import load_file, save_file

import evalkit.compression as ec
from evalkit.compression.learned_weights import LearnedFileError

SCORES = [[0.9, 0.1], [0.3, 0.7]]  # 2 layers x 2 KV heads, as kv_retrieval_tiny has


def duo(config: dict | str | None = None, tsv: str | None = None) -> tuple[Path, Path]:
    """A copy of a good pattern with its config.json or full_attention_heads.tsv replaced; the folder and the file
    replaced."""
    folder = copy_of(duo_pattern(SCORES))
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tsv is not None:
        (folder / "full_attention_heads.tsv").write_text(tsv)
    return folder, folder / ("config.json" if config is not None else "full_attention_heads.tsv")


def kvzap_copy(config: dict | None = None, tensors=None, raw: bytes | None = None, **shape) -> tuple[Path, Path]:
    """A copy of good KVzap surrogates (``shape``: learned_files.kvzap's) with config.json's keys updated by
    ``config``, or model.safetensors rewritten by ``tensors`` (its tensors -> new ones) or replaced by ``raw``
    bytes; the folder and the file changed."""
    folder = copy_of(kvzap(**shape))
    weights = folder / "model.safetensors"
    if config is not None:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
        return folder, path
    if tensors is not None:
        save_file(tensors(load_file(str(weights))), str(weights))
    if raw is not None:
        weights.write_bytes(raw)
    return folder, weights


def qfilter_copy(filters=None, raw: bytes | None = None) -> tuple[Path, Path]:
    folder = copy_of(qfilters())
    weights = folder / "model.safetensors"
    if filters is not None:
        save_file({"q_filters": filters(load_file(str(weights))["q_filters"])}, str(weights))
    if raw is not None:
        weights.write_bytes(raw)
    return folder, weights


def gates_copy(change=None, raw: bytes | None = None, name: str | None = None) -> Path:
    """A copy of good Fast-KVzip gates, its loaded content changed in place by ``change`` or its bytes replaced by
    ``raw``, renamed to ``name`` if given."""
    path = copy_of(fastkvzip_gates())
    if name is not None:
        path = path.rename(path.with_name(name))
    if change is not None:
        loaded = torch.load(path)
        change(loaded)
        torch.save(loaded, path)
    if raw is not None:
        path.write_bytes(raw)
    return path


def curve_copy(change=None, raw: bytes | None = None) -> Path:
    path = copy_of(lukv_curve())
    if change is not None:
        curve = np.load(path)
        curve = change(curve)
        np.save(path, curve)
    if raw is not None:
        path.write_bytes(raw)
    return path


def half(path: Path) -> bytes:
    return path.read_bytes()[: path.stat().st_size // 2]


def _set(tensors: dict, key: str, value) -> dict:
    tensors[key] = value
    return tensors


def _rename(tensors: dict, old: str, new: str) -> dict:
    tensors[new] = tensors.pop(old)
    return tensors


def _nan(tensor: torch.Tensor, where=(0,)) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[where] = float("nan")
    return tensor


def _layer(key: str, value):
    """A change of the first layer's ``key``: removed (None), set, or ``value(tensor)``."""
    def change(loaded):
        gate = loaded["module"][0]
        if value is None:
            del gate[key]
        else:
            gate[key] = value(gate[key]) if callable(value) else value
    return change


def _duo(**files):
    folder, path = duo(**files)
    return lambda: ec.DuoAttention(patterns=str(folder)), path


def _kvzap(**change):
    folder, path = kvzap_copy(**change)
    return lambda: ec.KVzap(capacity=20, weights=str(folder)), path


def _qfilter(**change):
    folder, path = qfilter_copy(**change)
    return lambda: ec.QFilter(capacity=20, filters=str(folder)), path


def _gates(**change):
    path = gates_copy(**change)
    return lambda: ec.FastKVzip(capacity=20, gates=str(path)), path


def _curve(**change):
    path = curve_copy(**change)
    return lambda: ec.LUKV.from_config(40, curve=str(path)), path


def _threshold(**change):
    folder, path = kvzap_copy(**change)
    return lambda: ec.Threshold.from_config(None, threshold=0.0, weights=str(folder)), path


def _kvzap_mlp_as_linear():
    """MLP surrogates whose config.json says linear (hidden_dim null): its tensors are not the ones it describes."""
    folder, _ = kvzap_copy(config={"hidden_dim": None}, hidden_dim=24)
    return lambda: ec.KVzap(capacity=20, weights=str(folder)), folder / "model.safetensors"


def _qfilter_named(name: str):
    folder, weights = qfilter_copy()
    save_file({name: load_file(str(weights))["q_filters"]}, str(weights))
    return lambda: ec.QFilter(capacity=20, filters=str(folder)), weights


def _saved(content) -> bytes:
    path = copy_of(fastkvzip_gates()).with_suffix(".tmp")
    torch.save(content, path)
    return path.read_bytes()


def _second_layer_wider(loaded):
    gate = loaded["module"][1]
    for key in ("q_proj.weight", "k_proj.weight"):
        gate[key] = gate[key][:, :32].contiguous()


def _nan_array(curve, where):
    return _put(curve, where, float("nan"))


def _put(curve, where, value):
    curve = curve.copy()
    curve[where] = value
    return curve


BUILT = {  # a damaged file, and what the one line says of it as the method is built
    "duo negative sink": (lambda: _duo(config={"sink_size": -4, "recent_size": 16}),
                          r"sink_size must be a whole number >= 0, got -4"),
    "duo negative recent": (lambda: _duo(config={"sink_size": 4, "recent_size": -16}),
                            r"recent_size must be a whole number >= 0, got -16"),
    "duo recent not an integer": (lambda: _duo(config={"sink_size": 4, "recent_size": 16.5}),
                                  r"recent_size must be a whole number >= 0, got 16.5"),
    "duo sink a string": (lambda: _duo(config={"sink_size": "4", "recent_size": 16}),
                          r"sink_size must be a whole number >= 0, got \"4\""),
    "duo sink a boolean": (lambda: _duo(config={"sink_size": True, "recent_size": 16}),
                           r"sink_size must be a whole number >= 0, got true"),
    "duo sink and recent 0": (lambda: _duo(config={"sink_size": 0, "recent_size": 0}),
                              r"sink_size and recent_size are both 0: a streaming head would keep no token"),
    "duo no recent": (lambda: _duo(config={"sink_size": 4}), r"has no recent_size"),
    "duo malformed config.json": (lambda: _duo(config='{"sink_size": 4, "recent_size": '),
                                  r"is not valid JSON: Expecting value at line 1, column 33"),
    "duo config.json a list": (lambda: _duo(config="[4, 16]"), r"holds a JSON list, not an object of settings"),
    "duo tsv not a number": (lambda: _duo(tsv="0.9\t0.1\n0.3\tabc\n"),
                             r"line 2, column 2: 'abc' is not a number"),
    "duo tsv columns differ": (lambda: _duo(tsv="0.9\t0.1\n0.3\t0.7\t0.5\n"),
                               r"line 2 has 3 columns, line 1 has 2: one tab-separated column per KV head"),
    "duo tsv nan": (lambda: _duo(tsv="0.9\tnan\n0.3\t0.7\n"),
                    r"line 1, column 2 is nan: scores must be finite numbers"),
    "duo tsv inf": (lambda: _duo(tsv="0.9\t0.1\n-inf\t0.7\n"),
                    r"line 2, column 1 is -inf: scores must be finite numbers"),
    "duo tsv empty": (lambda: _duo(tsv="\n"), r"holds no scores"),
    "kvzap corrupt header": (lambda: _kvzap(raw=b"\xff" * 8 + b"{not json"),
                             r"does not read as safetensors \(Error while deserializing header"),
    "kvzap cut short": (lambda: _kvzap(raw=half(kvzap() / "model.safetensors")),
                        r"does not read as safetensors \(Error while deserializing header: incomplete metadata"),
    "kvzap wrong name": (lambda: _kvzap(tensors=lambda t: _rename(t, "layers.1.bias", "layer.1.bias")),
                         r"holds no tensor 'layers.1.bias' \(1 of the 4 that config.json's 2 linear surrogates need"),
    "kvzap extra tensor": (lambda: _kvzap(tensors=lambda t: _set(t, "layers.2.weight", torch.zeros(2, 64))),
                           r"holds tensors config.json's 2 linear surrogates do not have: \['layers.2.weight'\]"),
    "kvzap mlp weights, linear config": (_kvzap_mlp_as_linear, r"holds no tensor 'layers.0.weight' \(4 of the 4"),
    "kvzap wrong shape": (lambda: _kvzap(tensors=lambda t: _set(t, "layers.0.weight", torch.zeros(2, 32))),
                          r"layers.0.weight has shape \[2, 32\], expected \[2, 64\]"),
    "kvzap wrong bias shape": (lambda: _kvzap(tensors=lambda t: _set(t, "layers.1.0.bias", torch.zeros(23)),
                                              hidden_dim=24),
                               r"layers.1.0.bias has shape \[23\], expected \[24\]"),
    "kvzap nan weights": (lambda: _kvzap(tensors=lambda t: _set(t, "layers.1.weight", _nan(t["layers.1.weight"],
                                                                                         (1, 5)))),
                          r"layers.1.weight holds nan at \[1, 5\]; learned weights must be finite numbers"),
    "kvzap integer weights": (lambda: _kvzap(tensors=lambda t: _set(t, "layers.0.bias", torch.ones(2).long())),
                              r"layers.0.bias holds int64, not floating point"),
    "kvzap negative n_modules": (lambda: _kvzap(config={"n_modules": -2}),
                                 r"n_modules must be a whole number >= 1, got -2"),
    "kvzap input_dim a string": (lambda: _kvzap(config={"input_dim": "64"}),
                                 r"input_dim must be a whole number >= 1, got \"64\""),
    "kvzap hidden_dim 0": (lambda: _kvzap(config={"hidden_dim": 0}, hidden_dim=24),
                           r"hidden_dim must be a whole number >= 1, got 0"),
    "qfilter corrupt header": (lambda: _qfilter(raw=b"\x10\x00\x00\x00\x00\x00\x00\x00{\"q_filters\": 1}"),
                               r"does not read as safetensors \(Error while deserializing header"),
    "qfilter wrong shape": (lambda: _qfilter(filters=lambda f: f[0]),
                            r"q_filters must be \[layers, kv_heads, head_dim\], got \[2, 16\]"),
    "qfilter nan": (lambda: _qfilter(filters=lambda f: _nan(f, (1, 0, 3))),
                    r"q_filters holds nan at \[1, 0, 3\]"),
    "qfilter no q_filters": (lambda: _qfilter_named("filters"),
                             r"holds no tensor 'q_filters' \(it holds \['filters'\]\)"),
    "fastkvzip corrupt file": (lambda: _gates(raw=b"not a torch.save file"),
                               r"does not read as a torch.save file \("),
    "fastkvzip cut short": (lambda: _gates(raw=half(fastkvzip_gates())), r"does not read as a torch.save file \("),
    "fastkvzip empty file": (lambda: _gates(raw=b""),
                             r"does not read as a torch.save file \(cut short or damaged: EOFError"),
    "fastkvzip a foreign object": (lambda: _gates(raw=_saved({"gates": [torch.zeros(2)]})),
                                   r"is not a Fast-KVzip gate file \(a dict with a 'module' list\)"),
    "fastkvzip no layers": (lambda: _gates(raw=_saved({"module": []})), r"has gates for no layer"),
    "fastkvzip missing key": (lambda: _gates(change=_layer("k_norm.weight", None)),
                              r"module\[0\] has no k_norm.weight \(a FastKVzipGate has"),
    "fastkvzip extra key": (lambda: _gates(change=_layer("v_proj.weight", torch.zeros(2, 2))),
                            r"module\[0\] holds \['v_proj.weight'\], which a FastKVzipGate does not"),
    "fastkvzip wrong q_proj shape": (lambda: _gates(change=_layer("q_proj.weight", lambda w: w[:-1])),
                                     r"module\[0\].q_proj.weight has shape \[63, 64\]; its k_base \[2, 1, 16, 16\] "
                                     r"and b \[2, 1, 2\] make it \[64, 64\]"),
    "fastkvzip wrong k_base rank": (lambda: _gates(change=_layer("k_base", lambda w: w[:, 0])),
                                    r"module\[0\]: k_base \[2, 16, 16\], b \[2, 1, 2\] and k_proj.weight \[32, 64\] "
                                    r"must be"),
    "fastkvzip sink other than its name": (lambda: _gates(name="q2_dim16_sink8.pt"),
                                           r"module\[0\] has sink 16, its name gives 8"),
    "fastkvzip no sink keys": (lambda: _gates(change=_layer("k_base", lambda k: k[:, :, :0]), name="gates.pt"),
                               r"module\[0\] has sink 0: its gates score nothing"),
    "fastkvzip layers differ": (lambda: _gates(change=_second_layer_wider),
                                r"module\[1\] has features 32, module\[0\] has 64"),
    "fastkvzip nan": (lambda: _gates(change=_layer("b", lambda b: _nan(b, (1, 0, 1)))),
                      r"module\[0\].b holds nan at \[1, 0, 1\]"),
    "lukv nan": (lambda: _curve(change=lambda c: _nan_array(c, (4, 1, 0))),
                 r"holds nan at \[4, 1, 0\] \(ratio 0.05, layer 1, head 0\); prune ratios are in \[0, 1\]"),
    "lukv above 1": (lambda: _curve(change=lambda c: _put(c, (98, 0, 1), 1.5)),
                     r"holds 1.5 at \[98, 0, 1\] \(ratio 0.99, layer 0, head 1\); prune ratios are in \[0, 1\]"),
    "lukv negative": (lambda: _curve(change=lambda c: _put(c, (0, 0, 0), -0.25)),
                      r"holds -0.25 at \[0, 0, 0\]"),
    "lukv wrong shape": (lambda: _curve(change=lambda c: c[:98]),
                         r"has shape \[98, 2, 2\]; an LU-KV curve is \[99, layers, kv_heads\]"),
    "lukv two dimensions": (lambda: _curve(change=lambda c: c[:, 0]),
                            r"has shape \[99, 2\]; an LU-KV curve is \[99, layers, kv_heads\]"),
    "lukv strings": (lambda: _curve(change=lambda c: c.astype(str)), r"holds <U\d+, not real numbers"),
    "lukv corrupt file": (lambda: _curve(raw=b"garbage"),
                          r"is no .npy file \(its first bytes are not numpy's\); an LU-KV curve is a .npy array"),
    "lukv cut short": (lambda: _curve(raw=half(lukv_curve())),
                       r"does not read as a .npy array \(Failed to read all data"),
    "threshold kvzap corrupt header": (lambda: _threshold(raw=b"\xff" * 8 + b"{not json"),
                                       r"does not read as safetensors \(Error while deserializing header"),
}


@pytest.mark.parametrize("make, message", BUILT.values(), ids=list(BUILT))
def test_a_bad_learned_file_is_refused_as_the_method_is_built(make, message):
    build, path = make()
    with pytest.raises(ValueError) as caught:
        build()
    line = str(caught.value)
    assert "\n" not in line
    assert str(path) in line, line
    assert re.search(message, line), line


def test_the_one_line_is_a_learned_file_error_for_every_method():
    """The methods raise the file's own error type, a ConfigError: the CLI's one line wherever it is raised (a
    wrapper such as Threshold passes its scorer's message on as a ValueError, which the config's check maps)."""
    for make in (BUILT["duo negative sink"][0], BUILT["kvzap corrupt header"][0], BUILT["qfilter nan"][0],
                 BUILT["fastkvzip corrupt file"][0], BUILT["lukv nan"][0]):
        build, _ = make()
        with pytest.raises(LearnedFileError):
            build()


def _whole(build, source: Path, file: str | None = None):
    """A method built on an undamaged file ``source``, and the file its one line names."""
    return lambda: build(str(source)), source / file if file else source


MODEL = {  # files good alone, made for 3 layers: refused at check_layers (a 2-layer model), before any prompt
    "duo rows": (lambda: _duo(tsv="0.9\t0.1\n0.3\t0.7\n0.5\t0.5\n"), r"scores 3 layers, the model has 2"),
    "kvzap layers": (lambda: _whole(lambda s: ec.KVzap(capacity=20, weights=s), kvzap(layers=3), "config.json"),
                     r"has surrogates for 3 layers \(n_modules\), the model has 2"),
    "qfilter layers": (lambda: _whole(lambda s: ec.QFilter(capacity=20, filters=s), qfilters(layers=3),
                                      "model.safetensors"), r"has filters for 3 layers, the model has 2"),
    "fastkvzip layers": (lambda: _whole(lambda s: ec.FastKVzip(capacity=20, gates=s), fastkvzip_gates(layers=3)),
                         r"has gates for 3 layers, the model has 2"),
    "lukv layers": (lambda: _whole(lambda s: ec.LUKV.from_config(40, curve=s), lukv_curve(layers=3)),
                    r"has shape \[99, 3, 2\]; the model needs \[99, 2, kv_heads\]"),
}


@pytest.mark.parametrize("make, message", MODEL.values(), ids=list(MODEL))
def test_a_learned_file_for_another_number_of_layers_is_refused_at_check_layers(make, message):
    build, path = make()
    policy = build()
    with pytest.raises(LearnedFileError) as caught:
        policy.check_layers(2)
    line = str(caught.value)
    assert str(path) in line and re.search(message, line), line


def one_line(result, tmp_path: Path, *fragments: str) -> str:
    """The CLI's answer to a mistake: exit 2, one `evalkit:` line on stderr holding ``fragments``, no traceback and
    no results folder."""
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "results").exists()
    return lines[0]


CLI = {  # method overrides for a damaged file, and what the one line says
    "duo negative sink": (lambda: duo(config={"sink_size": -4, "recent_size": 16}),
                          ["method=duo_attention", "method.patterns={folder}"],
                          "sink_size must be a whole number >= 0, got -4"),
    "kvzap corrupt header": (lambda: kvzap_copy(raw=b"\xff" * 8 + b"{not json", input_dim=128),
                             ["method=kvzap", "+budget=2x", "method.weights={folder}"],
                             "does not read as safetensors"),
    "fastkvzip corrupt file": (lambda: (gates_copy(raw=b"not a torch.save file"),) * 2,
                               ["method=fastkvzip", "+budget=2x", "method.gates={folder}"],
                               "does not read as a torch.save file"),
    "lukv nan": (lambda: (curve_copy(change=lambda c: _nan_array(c, (4, 1, 0))),) * 2,
                 ["method=lukv", "+budget=2x", "method.curve={folder}"], "prune ratios are in [0, 1]"),
    "threshold kvzap corrupt header": (lambda: kvzap_copy(raw=b"\xff" * 8 + b"{not json", input_dim=128),
                                       ["method=threshold", "method.threshold=0", "method.weights={folder}"],
                                       "does not read as safetensors"),
    # Good alone, wrong for the model's heads: refused at the first prompt's prefill, before anything is written
    "duo KV heads": (lambda: duo(tsv="0.9\t0.1\t0.5\n0.3\t0.7\t0.5\n"),
                     ["method=duo_attention", "method.patterns={folder}"], "scores 3 KV heads, the model has 2"),
    "qfilter head_dim": (lambda: (qfilters(), qfilters() / "model.safetensors"),
                         ["method=qfilter", "+budget=2x", "method.filters={folder}"],
                         "layer 0 has filters [2, 16] ([kv_heads, head_dim]), the model's keys are [2, 64]"),
}


@pytest.mark.parametrize("make, overrides, message", CLI.values(), ids=list(CLI))
def test_the_cli_says_one_line_and_writes_nothing(tmp_path, make, overrides, message):
    folder, path = make()
    result = evalkit(*(o.format(folder=folder) for o in overrides), "limit=2", f"results_dir={tmp_path / 'results'}",
                     cwd=tmp_path)
    one_line(result, tmp_path, str(path), message)
