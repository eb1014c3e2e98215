"""Query-aware methods beside kvpress' own presses at the model level: the same random GQA Llama and prompt through
kvpress' pipeline (a press around the model's forward) and evalkit's ``CompressionSession``: are the prompt tokens
each layer and KV head keeps the same?

    python benchmarks/parity_model.py [--length 600] [--venv .kvpress-venv]

The model (4 layers, 8 query and 2 KV heads of 32, fp32, seeded) and prompt are saved once and loaded by both sides,
kvpress 0.5.5 in its own environment (made on demand as in bench_vs_kvpress.py; where it cannot be made, one line and
exit 0). kvpress' side maps the keys its compressed cache holds back to the positions of its own uncompressed
prefill's keys; for presses that mask instead of evicting (AdaKV, CriticalAdaKV) its kept tokens are those its
``masked_key_indices`` leave. evalkit's side reads the positions its cache holds with ``ec.kept_positions``. Each keeps ``int(n * (1 - ratio))`` per head (AdaKV's: per layer on average) at
ratios 0.5 and 0.75. Per case and ratio a table prints the heads (over all layers) whose kept sets agree and the
positions that differ.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parity_runner import HERE, Parity, Side, kvpress_environment, run_parity, venv_option

RATIOS = (0.5, 0.75)
SNAPKV = {"window_size": 64, "kernel_size": 5}
# case: (kvpress' press from kvpress and the ratio, evalkit's method from evalkit.compression and the capacity)
CASES = {
    "snapkv": (lambda kp, r: kp.SnapKVPress(compression_ratio=r, **SNAPKV),
               lambda ec, c: ec.SnapKV(capacity=c, window=64, kernel_size=5, pooling="avg")),
    "expected_attention": (lambda kp, r: kp.ExpectedAttentionPress(compression_ratio=r),
                           lambda ec, c: ec.ExpectedAttention(capacity=c)),
    "adakv": (lambda kp, r: kp.AdaKVPress(kp.SnapKVPress(compression_ratio=r, **SNAPKV)),
              lambda ec, c: ec.AdaKV.from_config(c)),
    "criticalkv": (lambda kp, r: kp.CriticalKVPress(kp.SnapKVPress(compression_ratio=r, **SNAPKV)),
                   lambda ec, c: ec.CriticalKV.from_config(c)),
    "criticaladakv": (lambda kp, r: kp.CriticalAdaKVPress(kp.SnapKVPress(compression_ratio=r, **SNAPKV)),
                      lambda ec, c: ec.CriticalAdaKV.from_config(c)),
    "chunkkv": (lambda kp, r: kp.ChunkKVPress(kp.SnapKVPress(compression_ratio=r, **SNAPKV), chunk_length=20),
                lambda ec, c: ec.ChunkKV.from_config(c)),
    "entropy_gated_chunkkv": (lambda kp, r: kp.EntropyGatedChunkKVPress(kp.SnapKVPress(compression_ratio=r, **SNAPKV)),
                              lambda ec, c: ec.EntropyGatedChunkKV.from_config(c)),
    "chunkwise": (lambda kp, r: kp.ChunkPress(kp.SnapKVPress(compression_ratio=r, **SNAPKV), chunk_length=200),
                  lambda ec, c: ec.ChunkWise.from_config(c, chunk_length=200)),
    "capkv": (lambda kp, r: kp.CapPress(compression_ratio=r), lambda ec, c: ec.CapKV(capacity=c)),
    "compactor": (lambda kp, r: kp.CompactorPress(compression_ratio=r), lambda ec, c: ec.Compactor(capacity=c)),
    "non_causal_attention": (lambda kp, r: kp.NonCausalAttnPress(compression_ratio=r),
                             lambda ec, c: ec.NonCausalAttention(capacity=c)),
    "leverage": (lambda kp, r: kp.LeverageScorePress(compression_ratio=r), lambda ec, c: ec.LeverageScore(capacity=c)),
    "streaming_llm": (lambda kp, r: kp.StreamingLLMPress(compression_ratio=r, n_sink=4),
                      lambda ec, c: ec.StreamingLLM(sink=4, window=c - 4)),
}


def _held(full, keys, valid) -> list[list[int]]:
    """Per KV head, the positions of ``full`` ``[1, H, n, D]`` whose keys the valid slots of ``keys`` hold."""
    out = []
    for head in range(full.shape[1]):
        held = keys[0, head][valid[head]]
        matches = (held[:, None, :] == full[0, head][None, :, :]).all(dim=-1)
        out.append(sorted(int(i) for i in matches.float().argmax(dim=-1)[matches.any(dim=-1)]))
    return out


def full_keys(model, prompt):
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    return [layer.keys for layer in cache.layers]


def kept_by_kvpress(model, prompt) -> dict:
    import kvpress
    import torch
    from transformers import DynamicCache

    full, out = full_keys(model, prompt), {}
    for case, (make_press, _) in CASES.items():
        for r in RATIOS:
            press = make_press(kvpress, r)
            cache = DynamicCache()
            torch.manual_seed(0)  # leverage's sketch: kvpress draws from the global generator
            with torch.no_grad(), press(model):
                model(input_ids=prompt, past_key_values=cache, use_cache=True)
            out[f"{case}@{r}"] = kept_in_cache(model, cache, full)
    return out


def kept_in_cache(model, cache, full) -> list[list[list[int]]]:
    """Per layer and KV head, the positions of the full prefill's keys ``full`` that kvpress' ``cache`` holds and
    its press did not mask (``masked_key_indices``)."""
    import torch

    kept = []
    for index, layer in enumerate(cache.layers):
        masked = getattr(model.model.layers[index].self_attn, "masked_key_indices", None)
        valid = torch.ones(layer.keys.shape[1], layer.keys.shape[2], dtype=torch.bool)
        if masked is not None:
            valid[masked[1], masked[2]] = False
        kept.append(_held(full[index], layer.keys, valid))
    return kept


def agreement(theirs: list, ours: list) -> tuple[int, int, int]:
    """Kept positions per layer and head on both sides: the heads that agree, all heads, the positions that differ."""
    pairs = [(set(a), set(b)) for la, lb in zip(theirs, ours) for a, b in zip(la, lb)]
    return sum(a == b for a, b in pairs), len(pairs), sum(len(a ^ b) for a, b in pairs) // 2


def kept_by_evalkit(model, prompt) -> dict:
    import evalkit.compression as ec

    n, out = prompt.shape[1], {}
    for case, (_, make_method) in CASES.items():
        for r in RATIOS:
            session = ec.CompressionSession(model, make_method(ec, int(n * (1 - r))))
            session.prefill(prompt)
            out[f"{case}@{r}"] = [[head.tolist() for head in layer] for layer in ec.kept_positions(session)]
    return out


def save_model(folder: Path, length: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(folder)
    torch.save(torch.randint(3, 1000, (1, length), generator=torch.Generator().manual_seed(1)), folder / "prompt.pt")


def load_saved(folder: str, prompt: str | None = None):
    """The model :func:`save_model` wrote (sdpa attention) and its prompt (or the prompt file ``prompt``), as each
    side's worker loads them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    return model, torch.load(prompt or Path(folder) / "prompt.pt")


def model_options(parser: argparse.ArgumentParser) -> None:
    """The arguments of the model-level parity scripts: the prompt's length, kvpress' environment, and a worker's
    model folder."""
    parser.add_argument("--length", type=int, default=600)
    venv_option(parser, str(HERE.parent / ".kvpress-venv"))
    parser.add_argument("--model")


def loaded(side, folder: bool = False):
    """A side ``side(model, prompt)`` as a worker runs it: on the model and prompt :func:`save_model` wrote in
    ``args.model`` (``folder``: that folder too, ``side(model, prompt, folder)``)."""
    return lambda args: side(*load_saved(args.model), *([Path(args.model)] if folder else []))


SIDES = {"kvpress": Side(loaded(kept_by_kvpress), reference=True), "evalkit": Side(loaded(kept_by_evalkit))}


def compare(parity: Parity, args: argparse.Namespace) -> None:
    save_model(parity.folder, args.length)
    theirs, ours = parity.both("--model", str(parity.folder))
    print(f"{'method':<22} {'ratio':>5}  heads agreeing  positions differing")
    for key, kept in theirs.items():
        case, ratio = key.rsplit("@", 1)
        same, heads, differ = agreement(kept, ours[key])
        print(f"{case:<22} {ratio:>5}  {same}/{heads:<13} {differ}")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=model_options, environment=kvpress_environment)
