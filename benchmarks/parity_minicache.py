"""MiniCache beside KVCache-Factory's own functions (``pyramidkv/minicache.py``: ``compress_minicache_pair``,
``restore_minicache_pair``) on the same keys and values: a seeded tiny Llama's prompt cache, every adjacent pair of
layers merged at the reference's defaults, per pair and keys/values, whether the retained positions agree and how far
the restored states are apart.

    python benchmarks/parity_minicache.py --repo KVCache-Factory [--commit c97f9d7]

``--repo``: a clone (its work tree, or a bare git directory: the file is read at ``--commit``). The reference runs in
a throwaway process that imports the file from a temporary folder (and the rows' evalkit side). Two ways of feeding it: in float64, its merge held
in the cache's dtype and restored from that (evalkit's procedure: identical results expected), and as shipped, the
cache's fp32 tensors straight in (its angles in fp32, so a near tie may retain another token).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
from pathlib import Path

import torch
from parity_runner import Parity, Side, run_parity

FILE = "pyramidkv/minicache.py"
LAYERS, PROMPT = 4, 200


def reference_source(repo: Path, commit: str) -> str:
    work_tree = repo / FILE
    if work_tree.exists():
        return work_tree.read_text()
    return subprocess.run(["git", "--git-dir", str(repo), "show", f"{commit}:{FILE}"], check=True,
                          capture_output=True, text=True).stdout


def cache_states() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's prompt keys and values ``[1, H, n, D]`` of a seeded tiny Llama (a full cache)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import evalkit.compression as ec

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    session = ec.CompressionSession(model, ec.Full())
    session.prefill(torch.randint(3, 97, (1, PROMPT), generator=torch.Generator().manual_seed(1)))
    return [(layer.keys.clone(), layer.values.clone()) for layer in session.cache.layers]


def reference_side(module, current: torch.Tensor, previous: torch.Tensor, interpolation: float, ratio: float) -> dict:
    """The reference's functions on one pair ``[1, H, n, D]``: in float64 (held in the states' dtype between merge and
    restore) and as shipped (the states as they are)."""
    out = {}
    for way, (a, b) in (("float64", (current.double(), previous.double())), ("as shipped", (current, previous))):
        shared, cur_mag, prev_mag, _, cur_kept, prev_kept, index = module.compress_minicache_pair(
            a, b, interpolation=interpolation, retention_ratio=ratio)
        held = [t.to(current.dtype).to(a.dtype) for t in (shared, cur_mag, prev_mag, cur_kept, prev_kept)]
        restored = module.restore_minicache_pair(held[0], held[1], held[2], current_retained=held[3],
                                                 previous_retained=held[4], retained_indices=index)
        out[way] = {"retained": index, "restored": [r.to(current.dtype) for r in restored]}
    return out


def evalkit_side(current: torch.Tensor, previous: torch.Tensor, interpolation: float, ratio: float) -> dict:
    from evalkit.compression.methods.minicache import MergedPair

    pair = MergedPair.merge(current[0], previous[0], interpolation, ratio)
    return {"retained": pair.retained[None], "restored": [r[None] for r in pair.restore()], "bytes": pair.nbytes()}


def agreement(ours: dict, theirs: dict) -> tuple[str, str]:
    same = (ours["retained"] == theirs["retained"]).all(dim=-1)
    gap = max(float((a - b).abs().max()) for a, b in zip(ours["restored"], theirs["restored"]))
    exact = all(torch.equal(a, b) for a, b in zip(ours["restored"], theirs["restored"]))
    return f"{int(same.sum())}/{same.numel()} heads", "identical" if exact else f"max abs diff {gap:.2e}"


def rows(module, states, interpolation: float = 0.6, ratio: float = 0.05) -> list[str]:
    """One markdown row per pair of layers and keys/values."""
    out = []
    for previous in range(0, len(states) - 1, 2):
        for which, name in enumerate(("keys", "values")):
            current_states, previous_states = states[previous + 1][which], states[previous][which]
            ours = evalkit_side(current_states, previous_states, interpolation, ratio)
            theirs = reference_side(module, current_states, previous_states, interpolation, ratio)
            exact, shipped = agreement(ours, theirs["float64"]), agreement(ours, theirs["as shipped"])
            dense = 2 * current_states.numel() * current_states.element_size()
            out.append(f"| {previous}+{previous + 1} | {name} | {exact[0]} | {exact[1]} | {shipped[0]} | {shipped[1]} "
                       f"| {ours['bytes'] / dense:.1%} |")
    return out


def official_rows(args) -> list[str]:
    """:func:`rows` with the reference's file (at ``args.commit`` of ``args.repo``) imported from a temporary folder,
    on the states saved in ``args.states``."""
    with tempfile.TemporaryDirectory() as folder:
        reference = Path(folder) / "minicache.py"
        reference.write_text(reference_source(args.repo, args.commit))
        spec = importlib.util.spec_from_file_location("kvcache_factory_minicache", reference)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return rows(module, torch.load(args.states))


def options(parser) -> None:
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--commit", default="c97f9d7")
    parser.add_argument("--states", type=Path, help=argparse.SUPPRESS)


def compare(parity: Parity, args) -> None:
    states = parity.folder / "states.pt"
    torch.save(cache_states(), states)
    theirs = parity.run("official", "--repo", str(args.repo), "--commit", args.commit, "--states", str(states))
    print(f"KVCache-Factory {args.commit} {FILE} beside evalkit: a seeded {LAYERS}-layer Llama's {PROMPT}-token "
          "prompt cache (fp32), interpolation 0.6, retention ratio 0.05")
    print("| layers | states | retained, float64 | restored, float64 | retained, as shipped | restored, as shipped "
          "| pair held / dense |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(theirs))


if __name__ == "__main__":
    run_parity(__file__, __doc__, {"official": Side(official_rows)}, compare, options=options)
