"""GATECH-EIC/LaCache's own ``LaCache`` class beside evalkit's ``lacache``: the reference's
``LongBench/lacache/kv_cache.py`` (extracted from a clone or fetched copy of the repository into a temporary folder,
run in a throwaway process that imports only it and torch) is called as ``LongBench/pred.py`` calls it, once on a
prompt's cache and then after every decode step, on caches whose every entry carries its own text position; evalkit's
``CompressionSession`` runs a random Llama of the same depth over a prompt of the same length and as many steps. Per
case, after the prompt and after every step: do both hold the same positions in every layer?

    python benchmarks/parity_lacache.py --reference PATH/TO/LaCache [--steps 300]

``PATH/TO/LaCache``: the repository (a work tree, or a bare git directory, read at HEAD). The reference's
``cache_size`` is evalkit's ``capacity - 1 - (before - after) // 2`` and its ``start_size`` the per-prompt clamp of
``LongBench/pred.py`` (``LaCache.state_before``'s ladder and start). Positions only: the reference's rule reads no
key or value, and its re-rotation of keys by cache index is left out by evalkit (the method's docstring).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from parity_runner import Parity, Side, run_parity

# name: (layers, capacity, start_size, span, overlap, prompt tokens)
CASES = {
    "2 layers, span 1, start-over at prefill": (2, 40, 4, 1, 0, 100),
    "8 layers, span 2, raised size": (8, 50, 4, 2, 0, 200),
    "12 layers, span 3, start clamped": (12, 64, 128, 3, 0, 30),
    "8 layers, span 4, overlap 2": (8, 50, 4, 4, 2, 60),
    "32 layers, span 16 (defaults)": (32, 300, 128, 16, 0, 600),
}


def official_histories(args) -> dict:
    """Per case (``args.sizes``: the reference's sizes by case), the positions each layer holds after the prompt and
    after each step, by the reference's ``LaCache`` (its file imported from a temporary folder: torch only)."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "kv_cache.py").write_text(reference_source(args.reference))
        sys.path.insert(0, folder)
        from kv_cache import LaCache

    def tagged(positions):
        return torch.tensor(positions, dtype=torch.float64).view(1, 1, -1, 1)

    out = {}
    for name, (layers, cache_size, start, span, overlap, prompt, steps) in json.loads(args.sizes).items():
        cache = LaCache(cache_size=cache_size, start_size=start, span=span, overlap=overlap)
        held = [list(range(prompt))] * layers
        history = []
        for step in range(steps + 1):
            if step:
                held = [h + [prompt + step - 1] for h in held]
            legacy = cache(tuple((tagged(h), tagged(h)) for h in held))
            held = [k.flatten().long().tolist() for k, _ in legacy]
            history.append(held)
        out[name] = history
    return out


def reference_source(path: Path) -> str:
    relative = "LongBench/lacache/kv_cache.py"
    if (path / relative).is_file():
        return (path / relative).read_text()
    return subprocess.run(["git", "-C", str(path), "show", f"HEAD:{relative}"], check=True, capture_output=True,
                          text=True).stdout


def evalkit_side(steps: int) -> tuple[dict, dict]:
    """Per case, the positions each layer holds after the prompt and after each step, and the reference's sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import evalkit.compression as ec

    histories, sizes = {}, {}
    for name, (layers, capacity, start_size, span, overlap, prompt) in CASES.items():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
        model = LlamaForCausalLM(config).eval()
        policy = ec.LaCache(capacity=capacity, start_size=start_size, span=span, overlap=overlap)
        ladder, start, _ = policy.state_before(layers, prompt, 1)
        sizes[name] = (layers, capacity - 1 - ladder.reduce // 2, start, span, overlap, prompt, steps)
        session = ec.CompressionSession(model, policy)
        ids = torch.randint(3, 128, (1, prompt + steps), generator=torch.Generator().manual_seed(1))
        history = []
        with torch.no_grad():
            session.prefill(ids[:, :prompt])
            for step in range(steps + 1):
                if step:
                    session.step(ids[:, prompt + step - 1 : prompt + step])
                history.append([sorted(p.tolist()) for p in (heads[0] for heads in ec.kept_positions(session))])
        histories[name] = history
    return histories, sizes


def options(parser) -> None:
    parser.add_argument("--reference", type=Path, required=True, help="the GATECH-EIC/LaCache repository")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)


def compare(parity: Parity, args) -> None:
    ours, sizes = evalkit_side(args.steps)
    theirs = parity.run("official", "--reference", str(args.reference), "--sizes", json.dumps(sizes))
    print("| case | reference cache_size, start_size | calls agreeing | positions differing | held after |")
    print("|---|---|---|---|---|")
    for name, history in ours.items():
        other = theirs[name]
        agree = sum(a == b for a, b in zip(history, other))
        differ = sum(len(set(a) ^ set(b)) for x, y in zip(history, other) for a, b in zip(x, y))
        print(f"| {name} | {sizes[name][1]}, {sizes[name][2]} | {agree}/{len(other)} | {differ} | "
              f"{len(history[-1][0])} |")


if __name__ == "__main__":
    run_parity(__file__, __doc__, {"official": Side(official_histories)}, compare, options=options)
