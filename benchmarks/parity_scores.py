"""The prompt scorers evalkit shares with kvpress, on the same keys and values: are the kept positions the same?

    python benchmarks/parity_scores.py [--length 600] [--venv .kvpress-venv]

Random GQA keys and values (2 KV heads, seeded) are scored by kvpress 0.5.5's own presses in their own environment
(made on demand as in bench_vs_kvpress.py; where it cannot be made, one line and exit 0) and by evalkit's methods
through ``Policy.select``; each keeps ``int(n * (1 - compression_ratio))`` tokens per head at compression ratios 0.5
and 0.75. A table prints, per method and ratio, the heads whose kept sets agree, the positions that differ and
whether the two kept sets carry the same multiset of kvpress' own scores (then only ties were broken apart: kvpress'
``topk`` breaks them its own way, evalkit towards the earlier token).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
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
}


def kept_by_kvpress(tensors: dict) -> dict:
    import kvpress
    from kvpress.utils import compute_n_kept

    keys, values = tensors["keys"], tensors["values"]
    out = {}
    for case, ((press, settings), _) in CASES.items():
        for ratio in RATIOS:
            scores = getattr(kvpress, press)(compression_ratio=ratio, **settings).score(None, None, keys, values, None, {})
            top = scores.topk(compute_n_kept(keys.shape[2], ratio), dim=-1).indices[0]
            out[f"{case}@{ratio}"] = {"kept": [sorted(head.tolist()) for head in top], "scores": scores[0].tolist()}
    return out


def kept_by_evalkit(tensors: dict) -> dict:
    import torch

    import evalkit.compression as ec

    keys, values = tensors["keys"], tensors["values"]
    batch, kv_heads, n, dim = keys.shape
    view = ec.PrefillView(query=torch.zeros(batch, 2 * kv_heads, 1, dim), keys=keys, values=values,
                          key_valid=torch.ones(batch, n, dtype=torch.bool), scaling=dim ** -0.5, layer_idx=0,
                          num_layers=1, module=None, positions=torch.arange(n)[None])
    out = {}
    for case, (_, (method, settings)) in CASES.items():
        for ratio in RATIOS:
            keep = max(1, int(n * (1 - ratio)))
            indices, counts, _ = ec.POLICIES[method](capacity=keep, **settings).select(view, kv_heads)
            out[f"{case}@{ratio}"] = [sorted(head[:count].tolist()) for head, count in zip(indices[0], counts[0])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=600)
    parser.add_argument("--venv", default=str(HERE.parent / ".kvpress-venv"))
    parser.add_argument("--worker", choices=["kvpress", "evalkit"])
    parser.add_argument("--tensors")
    args = parser.parse_args()
    import torch

    if args.worker:
        tensors = torch.load(args.tensors)
        kept = kept_by_kvpress(tensors) if args.worker == "kvpress" else kept_by_evalkit(tensors)
        print("RESULT " + json.dumps(kept))
        return
    sys.path.insert(0, str(HERE))
    from bench_vs_kvpress import kvpress_python

    python = kvpress_python(Path(args.venv))
    if python is None:
        return
    generator = torch.Generator().manual_seed(0)
    tensors = {"keys": torch.randn(1, 2, args.length, 16, generator=generator),
               "values": torch.randn(1, 2, args.length, 16, generator=generator)}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tensors.pt"
        torch.save(tensors, path)
        sides = {side: run_side(python if side == "kvpress" else Path(sys.executable), side, path)
                 for side in ("kvpress", "evalkit")}
    print(f"{'method':<18} {'ratio':>5}  heads agreeing  positions differing  kvpress' scores of the kept equal")
    for key, reference in sides["kvpress"].items():
        theirs, ours, scores = reference["kept"], sides["evalkit"][key], reference["scores"]
        case, ratio = key.rsplit("@", 1)
        same = sum(a == b for a, b in zip(theirs, ours))
        differ = sum(len(set(a) ^ set(b)) for a, b in zip(theirs, ours)) // 2
        # Where the sets differ, whether only ties were broken apart: the same multiset of kvpress' own scores.
        ties = all(sorted(head[i] for i in a) == sorted(head[i] for i in b) for a, b, head in zip(theirs, ours, scores))
        print(f"{case:<18} {ratio:>5}  {same}/{len(theirs)}             {differ:<19}  {'yes' if ties else 'NO'}")


def run_side(python: Path, side: str, tensors: Path) -> dict:
    done = subprocess.run([str(python), __file__, "--worker", side, "--tensors", str(tensors)], capture_output=True,
                          text=True, env={"PYTHONPATH": str(HERE.parent), "PATH": "/usr/bin:/bin"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{side} worker failed: {done.stderr.strip()[-1500:]}")
    return json.loads(lines[-1][7:])


if __name__ == "__main__":
    main()
