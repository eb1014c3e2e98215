"""Speculative prefill: target prefill time with and without it, measured side by side in one run, as ratios.

    python benchmarks/bench_spec_prefill.py [--quick]

Target: a ~50M-parameter random Llama; draft: a small random Llama with the same tokenizer (the built-in task's);
prompt: built-in task entries, about 4k tokens (1k with --quick); keep 10%, chunks of 32, 8 look-ahead tokens.
Reports the target's prefill time on the kept tokens over its prefill time on the whole prompt (the TTFT saving on
the target) and the same including the draft's own time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import evalkit.compression as ec
from evalkit.models import synthetic
from evalkit.models.train_tiny import build_tokenizer


def llama(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16384)
    return LlamaForCausalLM(config).eval()


def long_prompt(tokens: int) -> str:
    rng, parts = random.Random(0), []
    while sum(len(p.split()) for p in parts) < tokens - 2:
        parts.append(synthetic.make_example(rng, 100, 0.5)["context"])
    words = " ".join(parts).split()[: tokens - 3]
    return " ".join(words) + " ? k7"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = 1 << 20  # long benchmark prompts; the models take 16k positions
    target = llama(len(tokenizer), 768, 8, 12, 4, seed=0)
    draft = llama(len(tokenizer), 128, 2, 4, 2, seed=1)
    text = long_prompt(1024 if args.quick else 4096)
    spec = ec.SpecPrefill(draft=draft, draft_tokenizer=tokenizer, keep=0.1, chunk_size=32, look_ahead_cnt=8)
    whole = tokenizer([text], return_tensors="pt")
    repeats = 3 if args.quick else 5
    full_times, spec_times, draft_times = [], [], []
    for repeat in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        ec.CompressionSession(target, ec.Full()).prefill(whole["input_ids"], whole["attention_mask"])
        full = time.perf_counter() - start
        ids, mask, positions, stats = spec.select([text], tokenizer, tokenizer.pad_token_id)
        start = time.perf_counter()
        ec.CompressionSession(target, ec.Full()).prefill(ids, mask, positions)
        kept = time.perf_counter() - start
        if repeat:
            full_times.append(full), spec_times.append(kept), draft_times.append(stats[0]["draft_seconds"])
    params = sum(p.numel() for p in target.parameters()) / 1e6
    t_full, t_spec, t_draft = (statistics.median(x) for x in (full_times, spec_times, draft_times))
    print(f"target: random Llama {params:.0f}M parameters; draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M;"
          f" prompt {whole['input_ids'].shape[1]} tokens, kept {stats[0]['kept_tokens']}; torch {torch.__version__}")
    print(f"{'full prefill s':>15} {'spec target s':>14} {'draft s':>8} {'target ratio':>13} {'with draft':>11}")
    print(f"{t_full:>15.3f} {t_spec:>14.3f} {t_draft:>8.3f} {t_spec / t_full:>13.3f} {(t_spec + t_draft) / t_full:>11.3f}")


if __name__ == "__main__":
    main()
