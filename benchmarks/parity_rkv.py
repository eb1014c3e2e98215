"""R-KV beside the reference repository's own code (Zefan-Cai/R-KV, its Hugging Face path: ``rkv/modeling.py``'s
attention with ``R1KV.update_kv``, ``divide_method="step_length"``): the same seeded GQA Llama and prompt, greedy
decoding, and after every step the positions each layer and KV head holds.

    python benchmarks/parity_rkv.py                       # evalkit against the shipped record
    python benchmarks/parity_rkv.py --repo R-KV [--venv .rkv-venv]   # run the reference and record it again

The reference needs transformers 4.51 (its attention replaces ``LlamaAttention.forward`` of that API); ``--repo``
runs it in its own environment (made on demand: torch and ``transformers==4.51.3``) from a checkout of the
repository, whose ``rkv/compression/__init__.py`` as shipped imports modules that do not exist (``.rkv``,
``.simkv``): the worker imports ``r1_kv.py`` under the name the package expects. Each step, the positions the
reference's cache holds are found by matching its keys to every key the model produced (recorded as the attention
computes them). Two variants of the reference run: as shipped, and with its top-k sorted into text order
(``indices.sort()``), the one difference from evalkit (see ``evalkit/compression/methods/rkv.py``). The record
(``benchmarks/records/rkv_reference.json``) keeps the tokens and, per step, the positions each head evicted.

The model's weights are drawn from a seeded generator in parameter-name order, so both transformers versions build
the same model without a file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from parity_runner import HERE, Parity, Side, run_parity

RECORD = HERE / "records" / "rkv_reference.json"
TRANSFORMERS = "transformers==4.51.3"
# (prompt tokens, R-KV budget, interval, generated tokens): a prompt over the budget (compressed at prefill, then
# every 128 tokens) and a short one that grows to the budget first, compressed every 32 tokens.
CASES = {"long_prompt": (300, 128, 128, 420), "short_prompt": (60, 96, 32, 300)}
WINDOW, KERNEL, LAMBDA = 8, 7, 0.07


def seeded_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model


def prompt_of(length: int):
    import torch

    return torch.randint(3, 1000, (1, length), generator=torch.Generator().manual_seed(length))


def evictions(before: list[list[list[int]]], after: list[list[list[int]]]) -> dict:
    """The positions each layer and head held before a step and not after it: ``{"layer.head": [...]}``."""
    out = {}
    for layer, (old, new) in enumerate(zip(before, after)):
        for head, (a, b) in enumerate(zip(old, new)):
            gone = sorted(set(a) - set(b))
            if gone:
                out[f"{layer}.{head}"] = gone
    return out


def trace(held_after_each_step: list, tokens: list[int]) -> dict:
    """Tokens and the evictions of every step (step 0: the prefill, from the whole prompt)."""
    steps = {}
    for step, held in enumerate(held_after_each_step):
        before = held_after_each_step[step - 1] if step else [[list(range(max(h) + 1)) for h in layer]
                                                                for layer in held]
        gone = evictions(before, held)
        if gone:
            steps[str(step)] = gone
    return {"tokens": tokens, "evicted": steps, "final": held_after_each_step[-1]}


# -- the reference ------------------------------------------------------------------------------------------------
def reference_trace(repo: str, length: int, budget: int, interval: int, new: int, sort_topk: bool) -> dict:
    import torch

    package = Path(tempfile.mkdtemp()) / "rkv"
    shutil.copytree(Path(repo) / "rkv", package)
    init = package / "compression" / "__init__.py"
    init.write_text(init.read_text().replace("from .rkv import", "from .r1_kv import").replace(
        "from .simkv import SimKV\n", ""))
    if sort_topk:
        source = package / "compression" / "r1_kv.py"
        text = source.read_text()
        line = "indices = final_score.topk(self.budget - self.window_size, dim=-1).indices"
        assert line in text, "the reference's top-k line changed"
        source.write_text(text.replace(line, line + ".sort(dim=-1).values"))
    sys.path.insert(0, str(package.parent))
    import rkv.modeling as modeling
    from rkv.monkeypatch import replace_llama
    from transformers import DynamicCache

    history: dict[int, list] = {}
    rotate = modeling.apply_rotary_pos_emb
    calls = [0]

    def recording(q, k, cos, sin, *args, **kwargs):  # every key the model produces, layer by layer
        q, k = rotate(q, k, cos, sin, *args, **kwargs)
        history.setdefault(calls[0] % 2, []).append(k)
        calls[0] += 1
        return q, k

    modeling.apply_rotary_pos_emb = recording
    replace_llama({"method": "rkv", "method_config": {"budget": budget, "window_size": WINDOW, "kernel_size": KERNEL,
                                                      "mix_lambda": LAMBDA, "retain_ratio": 0.2,
                                                      "retain_direction": "last", "first_tokens": 4},
                   "compression": None, "update_kv": True})
    model = seeded_llama()
    model.config.update({"divide_method": "step_length", "divide_length": interval, "compression_content": "all"})
    cache, tokens, held = DynamicCache(), [], []

    def positions() -> list:
        out = []
        for layer in range(2):
            every = torch.cat(history[layer], dim=2)[0]  # [H, T, D]
            keys = cache.key_cache[layer][0]
            out.append([((keys[h][:, None] == every[h][None]).all(-1).float().argmax(-1)).tolist()
                        for h in range(keys.shape[0])])
        return [[sorted(h) for h in layer] for layer in out]

    with torch.no_grad():
        ids = prompt_of(length)
        for step in range(new):
            # the text positions generate() gives (its cache_position counts every token, not the cache's length)
            at = torch.arange(ids.shape[1]) + (0 if step == 0 else length + step - 1)
            logits = model(input_ids=ids, position_ids=at[None], cache_position=at, past_key_values=cache,
                           use_cache=True).logits
            held.append(positions())
            tokens.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return trace(held, tokens)


# -- evalkit --------------------------------------------------------------------------------------------------------
def evalkit_trace(length: int, budget: int, interval: int, tokens: list[int]) -> dict:
    """evalkit's R-KV fed the reference's tokens (teacher forced): its own greedy choices and holdings."""
    import torch

    import evalkit.compression as ec

    model = seeded_llama()
    policy = ec.RKV(capacity=budget + interval, window=WINDOW, interval=interval, kernel_size=KERNEL,
                    mix_lambda=LAMBDA)
    session = ec.CompressionSession(model, policy)

    def holding() -> list:
        return [[sorted(layer.heads.positions[0, h][layer.heads.valid[0, h]].tolist())
                 for h in range(layer.heads.valid.shape[1])] for layer in session.cache.layers]

    with torch.no_grad():
        logits = session.prefill(prompt_of(length))[0]
        held, chosen = [holding()], [int(logits.argmax())]
        for token in tokens[:-1]:
            logits = session.step(torch.tensor([[token]]))[0, -1]
            held.append(holding())
            chosen.append(int(logits.argmax()))
    return trace(held, chosen)


def compare_traces(reference: dict, ours: dict) -> tuple[int, int, int | None]:
    """Steps whose evictions agree, steps compared, and the first step that differs (None: none)."""
    steps = sorted({*map(int, reference["evicted"]), *map(int, ours["evicted"])})
    differing = [s for s in steps if reference["evicted"].get(str(s)) != ours["evicted"].get(str(s))]
    return len(reference["tokens"]) - len(differing), len(reference["tokens"]), (differing[0] if differing else None)


def options(parser) -> None:
    parser.add_argument("--repo", help="a checkout of Zefan-Cai/R-KV: run the reference and write the record")
    parser.add_argument("--venv", default=str(HERE.parent / ".rkv-venv"))
    parser.add_argument("--case")
    parser.add_argument("--sorted", action="store_true")


def environment(args) -> Path | None:
    """With ``--repo``: the reference's interpreter (transformers 4.51.3), made on demand."""
    if not args.repo:
        return Path(sys.executable)
    from bench_vs_kvpress import reference_python

    return reference_python(Path(args.venv), [TRANSFORMERS], "import transformers; assert transformers.__version__ "
                            "== '4.51.3'", "the reference's environment", "the reference's API")


SIDES = {"reference": Side(lambda args: reference_trace(args.repo, *CASES[args.case], sort_topk=args.sorted),
                           reference=True)}


def compare(parity: Parity, args) -> None:
    if args.repo:
        record = {"reference": "Zefan-Cai/R-KV " + subprocess.run(
                      ["git", "-C", args.repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
                  "transformers": TRANSFORMERS, "cases": {}}
        for case in CASES:
            for variant, flag in (("as_shipped", []), ("sorted_topk", ["--sorted"])):
                record["cases"][f"{case}/{variant}"] = parity.run("reference", "--repo", args.repo, "--case", case,
                                                                  *flag)
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(record))
    record = json.loads(RECORD.read_text())
    print(f"R-KV beside {record['reference']} ({record['transformers']}), window {WINDOW}, kernel {KERNEL}, "
          f"lambda {LAMBDA}")
    print(f"{'case':<14} {'reference':<12} {'tokens equal':>12} {'steps agreeing':>15} {'first differing step':>21}")
    for key, reference in record["cases"].items():
        case, variant = key.split("/")
        length, budget, interval, _ = CASES[case]
        ours = evalkit_trace(length, budget, interval, reference["tokens"])
        same, steps, first = compare_traces(reference, ours)
        equal = ours["tokens"] == reference["tokens"]
        print(f"{case:<14} {variant:<12} {str(equal):>12} {f'{same}/{steps}':>15} {str(first):>21}")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=options, environment=environment)
