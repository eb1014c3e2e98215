"""The prompt scorers evalkit shares with kvpress, on the same keys and values: are the kept positions the same?

    python benchmarks/parity_scores.py [--length 600] [--venv .kvpress-venv]

Random GQA keys, values and hidden states (2 KV heads, seeded) are scored by kvpress 0.5.5's own presses in their
own environment (made on demand as in bench_vs_kvpress.py; where it cannot be made, one line and exit 0) and by
evalkit's methods through ``Policy.select``; each keeps ``int(n * (1 - compression_ratio))`` tokens per head at
compression ratios 0.5 and 0.75. Learned weights are kvpress' own: its ``KVzapModel``, random, written by its
``save_pretrained`` and read by evalkit from that folder; Q-Filters as ``PyTorchModelHubMixin`` saves them. Presses
that select rather than score (``BlockPress``, ``ChunkKVPress`` and ``EntropyGatedChunkKVPress`` over KeyDiff,
``DMSPress`` over KVzap at two thresholds, ``FastKVzipPress`` layer-wise with kvpress' own gate saved as released)
run whole. A table prints, per method and ratio, the tokens each head
keeps, the heads whose kept sets agree, the positions that differ and whether the two kept sets carry the same
multiset of kvpress' own scores (then only ties were broken apart: kvpress' ``topk`` breaks them its own way,
evalkit towards the earlier token).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parity_runner import HERE, Parity, Side, kvpress_environment, run_parity, venv_option

RATIOS = (0.5, 0.75)
# name: (kvpress press and its arguments, evalkit method and its settings)
CASES = {
    "keydiff": (("KeyDiffPress", {}), ("keydiff", {})),
    "lagkv": (("LagKVPress", {}), ("lagkv", {})),
    "lagkv lag 32": (("LagKVPress", {"lag_size": 32}), ("lagkv", {"lag_size": 32})),
    "lagkv cross": (("LagKVPress", {"lag_size": 32, "cross_scoring": True}),
                    ("lagkv", {"lag_size": 32, "cross_scoring": True})),
    "cur": (("CURPress", {}), ("cur", {})),
    "cur kv_avg whole": (("CURPress", {"leverage_type": "kv_avg", "use_local_approximation": False}),
                         ("cur", {"leverage_type": "kv_avg", "local_window_size": 0})),
    "knorm": (("KnormPress", {}), ("knorm", {})),
    "qfilter": (("QFilterPress", {}), ("qfilter", {})),
    "kvzap mlp": (("KVzapPress", {}), ("kvzap", {})),
}
# Presses that select themselves: name -> (kvpress press, evalkit method, settings of each).
SELECTING = {
    "blockwise keydiff 128": ("BlockPress", "blockwise", {"block_size": 128}),
    "blockwise keydiff 50": ("BlockPress", "blockwise", {"block_size": 50}),
    "chunkkv keydiff 0.5": ("ChunkKVPress", "chunkkv", {"chunk_length": 20}),
    "chunkkv keydiff 0.75": ("ChunkKVPress", "chunkkv", {"chunk_length": 20}),
    "entropy chunkkv keydiff 0.5": ("EntropyGatedChunkKVPress", "entropy_gated_chunkkv", {}),
    "entropy chunkkv keydiff 0.75": ("EntropyGatedChunkKVPress", "entropy_gated_chunkkv", {}),
    "fastkvzip 0.5": ("FastKVzipPress", "fastkvzip", {}),
    "fastkvzip 0.75": ("FastKVzipPress", "fastkvzip", {}),
    "threshold kvzap 0.0": ("DMSPress", "threshold", {"threshold": 0.0, "sliding_window_size": 64}),
    "threshold kvzap 0.5": ("DMSPress", "threshold", {"threshold": 0.5, "sliding_window_size": 64}),
}
HIDDEN = 64  # the hidden states' width KVzap reads


def kvpress_press(press: str, ratio: float, settings: dict, tensors: dict):
    """A kvpress press, its learned weights loaded from the case's folders."""
    import kvpress

    made = getattr(kvpress, press)(compression_ratio=ratio, **settings)
    if press == "QFilterPress":
        made.q_filters = tensors["filters"]
    if press == "KVzapPress":
        from kvpress.presses.kvzap_press import KVzapModel

        made.kvzap_model = KVzapModel.from_pretrained(tensors["kvzap"])
    return made


def save_kvzap(folder: str) -> None:
    """kvpress' own KVzap surrogate (a 2-layer MLP, random), saved as its publishers save theirs."""
    import torch
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    torch.manual_seed(0)
    model = KVzapModel(KVzapConfig(input_dim=HIDDEN, output_dim=2, n_modules=1, hidden_dim=32))
    for parameter in model.parameters():  # scores on the scale of a trained surrogate's
        torch.nn.init.normal_(parameter, std=0.3)
    model.save_pretrained(folder)


def save_gates(path: str) -> list:
    """kvpress' own Fast-KVzip gate (one layer, random), saved as its publishers release theirs."""
    import torch
    from kvpress.presses.fastkvzip_press import FastKVzipGate

    torch.manual_seed(1)
    gate = FastKVzipGate(0, HIDDEN, nhead=2, ngroup=2, dtype=torch.float32, output_dim=16, sink=16)
    for parameter in gate.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    torch.save({"module": [gate.state_dict()]}, path)
    return [gate]


def fastkvzip_kept(case: str, tensors: dict) -> list[list[int]]:
    """kvpress' FastKVzipPress (layer-wise) on the hidden states: its own scoring and pruning code, one layer."""
    import types

    from kvpress import FastKVzipPress

    press = FastKVzipPress(compression_ratio=float(case.rsplit(" ", 1)[1]), layerwise=True)
    press.gates = save_gates(tensors["gates"])
    module = types.SimpleNamespace(layer_idx=0, config=types.SimpleNamespace(_attn_implementation="sdpa"))
    press.score_val = [None]
    press._score_fast(module, tensors["hidden"])
    press.compress_post(types.SimpleNamespace(model=types.SimpleNamespace(layers=[types.SimpleNamespace(
        self_attn=module)])))
    n = tensors["hidden"].shape[1]
    masked = [set() for _ in range(2)]
    for _, head, position in zip(*(index.tolist() for index in module.masked_key_indices)):
        masked[head].add(position)
    return [sorted(set(range(n)) - heads) for heads in masked]


def selected_by_kvpress(case: str, tensors: dict) -> list[list[int]]:
    """The positions a selecting press keeps, per head."""
    import types

    import torch
    from kvpress import DMSPress, KeyDiffPress
    from transformers import DynamicCache

    press, _, settings = SELECTING[case]
    keys, values, hidden = tensors["keys"], tensors["values"], tensors["hidden"]
    n = keys.shape[2]
    if press == "FastKVzipPress":
        return fastkvzip_kept(case, tensors)
    if press != "DMSPress":  # a press over KeyDiff at the case's ratio (BlockPress: 0.5)
        import kvpress

        ratio = float(case.rsplit(" ", 1)[1]) if press != "BlockPress" else 0.5
        made = getattr(kvpress, press)(press=KeyDiffPress(compression_ratio=ratio), **settings)
        kept_keys, _ = made.compress(types.SimpleNamespace(head_dim=16), torch.zeros(1, n, 2 * 8), keys, values, None,
                                     {})
        return [sorted(int((keys[0, h] == row).all(dim=-1).nonzero()) for row in kept_keys[0, h]) for h in range(2)]
    scorer = kvpress_press("KVzapPress", 0.0, {}, tensors)
    dms = DMSPress(press=scorer, **settings)
    module = types.SimpleNamespace(layer_idx=0, masked_key_indices=None)
    cache = DynamicCache()
    cache.update(keys, values, 0)
    dms.forward_hook(module, [], {"hidden_states": hidden, "past_key_values": cache,
                                  "cache_position": torch.arange(n)}, None)
    masked = [set() for _ in range(2)]
    if module.masked_key_indices is not None:
        for _, head, position in zip(*(index.tolist() for index in module.masked_key_indices)):
            masked[head].add(position)
    return [sorted(set(range(n)) - heads) for heads in masked]


def kept_by_kvpress(tensors: dict) -> dict:
    import types

    from kvpress.utils import compute_n_kept

    save_kvzap(tensors["kvzap"])
    keys, values, hidden = tensors["keys"], tensors["values"], tensors["hidden"]
    module = types.SimpleNamespace(layer_idx=0)
    out = {}
    for case, ((press, settings), _) in CASES.items():
        for ratio in RATIOS:
            scores = kvpress_press(press, ratio, settings, tensors).score(module, hidden, keys, values, None, {})
            top = scores.topk(compute_n_kept(keys.shape[2], ratio), dim=-1).indices[0]
            out[f"{case}@{ratio}"] = {"kept": [sorted(head.tolist()) for head in top], "scores": scores[0].tolist()}
    for case in SELECTING:
        out[f"{case}@-"] = {"kept": selected_by_kvpress(case, tensors), "scores": None}
    return out


def kept_by_evalkit(tensors: dict) -> dict:
    import torch

    import evalkit.compression as ec

    keys, values = tensors["keys"], tensors["values"]
    batch, kv_heads, n, dim = keys.shape
    view = ec.PrefillView(query=torch.zeros(batch, 2 * kv_heads, 1, dim), keys=keys, values=values,
                          key_valid=torch.ones(batch, n, dtype=torch.bool), scaling=dim ** -0.5, layer_idx=0,
                          num_layers=1, module=None, positions=torch.arange(n)[None], hidden=tensors["hidden"])
    learned = {"qfilter": {"filters": tensors["filters_dir"]}, "kvzap": {"weights": tensors["kvzap"]}}

    def kept(policy) -> list[list[int]]:
        indices, counts, _ = policy.select(view, kv_heads)
        return [sorted(head[:count].tolist()) for head, count in zip(indices[0], counts[0])]

    out = {}
    for case, (_, (method, settings)) in CASES.items():
        for ratio in RATIOS:
            keep = max(1, int(n * (1 - ratio)))
            out[f"{case}@{ratio}"] = kept(ec.POLICIES[method](capacity=keep, **settings, **learned.get(method, {})))
    for case, (_, method, settings) in SELECTING.items():
        if method == "blockwise":
            policy = ec.BlockWise(capacity=max(1, int(n * 0.5)), **settings)
        elif method == "fastkvzip":
            ratio = float(case.rsplit(" ", 1)[1])
            policy = ec.FastKVzip(capacity=max(1, int(n * (1 - ratio))), gates=tensors["gates"])
        elif method != "threshold":
            ratio = float(case.rsplit(" ", 1)[1])
            policy = ec.POLICIES[method](capacity=max(1, int(n * (1 - ratio))), scorer="keydiff", **settings)
        else:
            policy = ec.Threshold(**settings, scorer={"name": "kvzap", "weights": tensors["kvzap"]})
        out[f"{case}@-"] = kept(policy)
    return out


def tensors_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=int, default=600)
    venv_option(parser, str(HERE.parent / ".kvpress-venv"))
    parser.add_argument("--tensors")


def loaded(side):
    """A side ``side(tensors)`` as a worker runs it: on the tensors :func:`save_tensors` wrote."""

    def compute(args: argparse.Namespace) -> dict:
        import torch

        return side(torch.load(args.tensors))

    return compute


SIDES = {"kvpress": Side(loaded(kept_by_kvpress), reference=True), "evalkit": Side(loaded(kept_by_evalkit))}


def save_tensors(folder: Path, length: int) -> Path:
    """The seeded keys, values, hidden states and Q-Filters both sides score, and where the learned weights go."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {"keys": torch.randn(1, 2, length, 16, generator=generator),
               "values": torch.randn(1, 2, length, 16, generator=generator),
               "hidden": torch.randn(1, length, HIDDEN, generator=generator),
               "filters": torch.randn(1, 2, 16, generator=generator)}
    path = folder / "tensors.pt"
    tensors["kvzap"], tensors["filters_dir"] = str(folder / "kvzap"), str(folder / "qfilt")
    tensors["gates"] = str(folder / "q2_dim16_sink16.pt")
    Path(tensors["filters_dir"]).mkdir()
    save_file({"q_filters": tensors["filters"]}, str(Path(tensors["filters_dir"]) / "model.safetensors"))
    torch.save(tensors, path)
    return path


def compare(parity: Parity, args: argparse.Namespace) -> None:
    theirs_all, ours_all = parity.both("--tensors", str(save_tensors(parity.folder, args.length)))
    print(f"{'method':<28} {'ratio':>5}  {'kept':>9}  heads agreeing  positions differing  kvpress' scores of the kept equal")
    for key, reference in theirs_all.items():
        theirs, ours, scores = reference["kept"], ours_all[key], reference["scores"]
        case, ratio = key.rsplit("@", 1)
        same = sum(a == b for a, b in zip(theirs, ours))
        differ = sum(len(set(a) ^ set(b)) for a, b in zip(theirs, ours)) // 2
        # Where the sets differ, whether only ties were broken apart: the same multiset of kvpress' own scores.
        ties = "-" if scores is None else "yes" if all(
            sorted(head[i] for i in a) == sorted(head[i] for i in b) for a, b, head in zip(theirs, ours, scores)) else "NO"
        kept = "/".join(str(len(head)) for head in ours)
        print(f"{case:<28} {ratio:>5}  {kept:>9}  {same}/{len(theirs)}             {differ:<19}  {ties}")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=tensors_option, environment=kvpress_environment)
