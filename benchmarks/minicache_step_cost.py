"""What MiniCache's merged storage costs a decode step: a seeded tiny random Llama (the tests' shape, or wider), a
prompt of ``--tokens`` tokens, ``--steps`` greedy decode steps timed one by one, under Full, MiniCache
holding its merged layers restored and dense (what the cache held before :mod:`evalkit.compression.merged_storage`),
and MiniCache holding them merged (each merged layer restored into the lent workspace every step); with each one's
held bytes after prefill, measured off the cache's tensors.

    python benchmarks/minicache_step_cost.py [--tokens 1024] [--steps 64] [--layers 4] [--hidden 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

import evalkit.compression as ec
from evalkit.compression import cache as cache_module


def model_of(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=hidden * 3 // 2, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def prefilled(model, policy, prompt: torch.Tensor):
    """A session after ``prompt``, its held bytes (measured off the cache's tensors) and its first token."""
    session = ec.CompressionSession(model, policy)
    logits = session.prefill(prompt)[:, -1]
    return session, sum(cache_module._held_bytes(layer) for layer in session.cache.layers), [int(logits.argmax())]


def interleaved(sessions: list, steps: int) -> list[tuple[float, float]]:
    """Each session's greedy decode steps, the sessions taking turns step by step (a busy machine slows them alike):
    per session the median and the fastest step's seconds."""
    seconds = [[] for _ in sessions]
    for _ in range(steps):
        for (session, _, tokens), spent in zip(sessions, seconds):
            started = time.perf_counter()
            logits = session.step(torch.tensor([[tokens[-1]]]))[:, -1]
            spent.append(time.perf_counter() - started)
            tokens.append(int(logits.argmax()))
    return [(statistics.median(spent), min(spent)) for spent in seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    model = model_of(args.layers, args.hidden)
    prompt = torch.randint(3, 97, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    full = prefilled(model, ec.Full(), prompt)
    with mock.patch.object(cache_module, "hold_merged", lambda cache, layer_idx: None):
        dense = prefilled(model, ec.MiniCache(), prompt)
    merged = prefilled(model, ec.MiniCache(), prompt)
    interleaved([full, dense, merged], 4)  # warm up
    timings = interleaved([full, dense, merged], args.steps)
    assert merged[2] == dense[2], "the merged storage changed the generated tokens"
    print(f"tiny Llama ({args.layers} layers, hidden {args.hidden}, fp32, CPU, {args.threads} thread(s)): "
          f"{args.tokens}-token prompt, {args.steps} decode steps, the three caches taking turns")
    print("| cache | held after prefill (KiB) | freed | decode step, median (ms) | fastest (ms) | median vs Full |")
    print("|---|---|---|---|---|---|")
    names = ("full", "minicache, restored layers held dense", "minicache, merged storage")
    for name, (_, held, _), (median, fastest) in zip(names, (full, dense, merged), timings):
        print(f"| {name} | {held / 1024:.1f} | {1 - held / full[1]:.1%} | {median * 1e3:.3f} | {fastest * 1e3:.3f} | "
              f"{median / timings[0][0]:.2f}x |")


if __name__ == "__main__":
    main()
