"""KVgrad against a plain float64 definition of its score (the model run in float64 over the prompt and each pass,
its attention written out, the gradient by autograd, the score by loops): the positions kept per layer and KV head,
the scores themselves, the cache really shrunk, the tokens and logits of a full-cache run that hides the rest, and
what its passes hold (kvpress' own kept sets: benchmarks/parity_kvgrad.py)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import TINY_RECONSTRUCTION, VOCAB, tiny_model
from masked_reference import module_scaling
from test_methods import held_positions, reference_keys
from test_nacl import masked_logits
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

import evalkit.compression as ec
from evalkit.compression import reconstruction

N = 90
GAP = 1e-4  # the least relative gap between the last kept score and the first dropped one (fp32 lands near 1e-6)
_SEEN: dict = {}  # layer -> the post-RoPE query [Hq, T, D] and key and value [Hkv, T, D] of the last float64 run


def _plain_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal softmax attention written out (float64 here), recording what it saw."""
    _SEEN[module.layer_idx] = (query[0].detach(), key[0].detach(), value[0].detach())
    group = query.shape[1] // key.shape[1]
    logits = query @ key.repeat_interleave(group, dim=1).transpose(-1, -2) * scaling
    count, total = query.shape[2], key.shape[2]
    logits = logits.masked_fill(~torch.ones(count, total, dtype=torch.bool).tril(total - count), float("-inf"))
    return (logits.softmax(dim=-1) @ value.repeat_interleave(group, dim=1)).transpose(1, 2).contiguous(), None


AttentionInterface.register("kvgrad_plain", _plain_attention)
AttentionMaskInterface.register("kvgrad_plain", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def distinct_prompt(seed: int = 0) -> torch.Tensor:
    return (3 + torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(seed))[:N])[None]


def prompts_with_prefix(prefix: int):
    return dataclasses.replace(TINY_RECONSTRUCTION, prefix=tuple(distinct_prompt()[0, :prefix].tolist()))


def sensitivities(double, ids: list[int], n: int) -> dict[int, torch.Tensor]:
    """One float64 run of ``ids`` (the prompt, then a pass): per layer, ||d Phi / d a_p|| for every pass token p,
    Phi the sum of ||h_p||^2 over the pass's tokens, h the last decoder layer's output, a the attention's."""
    outputs = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o: outputs.__setitem__(m.layer_idx, o[0]))
             for layer in double.model.layers]
    hooks.append(double.model.layers[-1].register_forward_hook(lambda m, a, o: outputs.__setitem__("h", o)))
    try:
        embedded = double.model.embed_tokens(torch.tensor([ids])).requires_grad_()
        double(inputs_embeds=embedded, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    phi = outputs["h"][0, n:].pow(2).sum()
    layers = range(len(double.model.layers))
    gradients = torch.autograd.grad(phi, [outputs[layer] for layer in layers])
    return {layer: g[0, n:].norm(dim=-1) for layer, g in zip(layers, gradients)}


def reference_scores(model, prompt: torch.Tensor, prompts, chunk: int, sink: int = 4) -> torch.Tensor:
    """``[L, Hkv, n]``: KVgrad's score of every prompt token, in float64 (0 for a chat prefix it skips)."""
    double = copy.deepcopy(model).double().requires_grad_(False)
    double.config._attn_implementation = "kvgrad_plain"
    tokens, n, scaling = prompt[0].tolist(), prompt.shape[1], module_scaling(model)
    first = len(prompts.prefix) if tuple(tokens[: len(prompts.prefix)]) == prompts.prefix else 0
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    scores = torch.zeros(layers, kv_heads, n, dtype=torch.float64)
    for begin in range(first, n, chunk):
        end = min(begin + chunk, n)
        ask = list(prompts.first) if begin == first else [*prompts.next, *tokens[max(first, begin - 8) : begin]]
        passed = [*ask, *prompts.suffix, *tokens[begin:end]]
        grad = sensitivities(double, tokens + passed, n)
        for layer in range(layers):
            query, key, value = _SEEN[layer]
            out = double.model.layers[layer].self_attn.o_proj.weight
            group, dim = query.shape[0] // kv_heads, query.shape[-1]
            for q_head in range(query.shape[0]):
                kv = q_head // group
                written = {c: float((out[:, q_head * dim : (q_head + 1) * dim] @ value[kv, c]).norm())
                           for c in range(begin, end)}
                for t in range(len(passed)):
                    columns = [*range(min(sink, begin)), *range(begin, end), *range(n, n + t + 1)]
                    weights = ((key[kv, columns] @ query[q_head, n + t]) * scaling).softmax(dim=0)
                    for offset, c in enumerate(columns[min(sink, begin) : min(sink, begin) + end - begin]):
                        score = float(weights[min(sink, begin) + offset]) * written[c] * float(grad[layer][t])
                        scores[layer, kv, c] = max(float(scores[layer, kv, c]), score)
    return scores


def kept_by_definition(scores: torch.Tensor, capacity: int, sink: int = 4, layerwise: bool = False):
    """Per layer and KV head, the positions kept: the first ``sink``, then the best ``layers * kv_heads * capacity``
    scores of the whole model (``layerwise``: ``kv_heads * capacity`` per layer), ties to the earlier (layer, head,
    position); the cut checked to be no near-tie."""
    layers, kv_heads, n = scores.shape
    ranked = scores.clone()
    ranked[:, :, : min(sink, n)] = float("inf")
    pools = [list(range(layers))] if not layerwise else [[layer] for layer in range(layers)]
    kept = {layer: [set() for _ in range(kv_heads)] for layer in range(layers)}
    for pool in pools:
        entries = sorted((-float(ranked[l, h, j]), l, h, j) for l in pool for h in range(kv_heads) for j in range(n))
        count = len(pool) * kv_heads * min(capacity, n)
        if count < len(entries):
            inside, outside = -entries[count - 1][0], -entries[count][0]
            assert inside - outside > GAP * abs(inside), "a near-tie at the cut: pick other inputs"
        for _, layer, head, position in entries[:count]:
            kept[layer][head].add(position)
    return kept


CASES = {  # case: (the method, its reference's reconstruction prompt, chunk and sink, the prompt's seed)
    "chunks of 32": (lambda: ec.KVgrad(capacity=30, chunk_size=32).with_prompts(TINY_RECONSTRUCTION),
                     TINY_RECONSTRUCTION, 32, 4, 0),
    "one pass, sink 2, layerwise": (lambda: ec.KVgrad(capacity=30, chunk_size=N, sink=2, layerwise=True)
                                    .with_prompts(TINY_RECONSTRUCTION), TINY_RECONSTRUCTION, N, 2, 1),
    "chat prefix, chunks of 40": (lambda: ec.KVgrad(capacity=24, chunk_size=40).with_prompts(prompts_with_prefix(3)),
                                  prompts_with_prefix(3), 40, 4, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kvgrad_keeps_what_its_float64_definition_keeps(llama, case, monkeypatch):
    build, prompts, chunk, sink, seed = CASES[case]
    policy, prompt = build(), distinct_prompt(seed)
    written = torch.zeros(llama.config.num_hidden_layers, llama.config.num_key_value_heads, N)

    def write(observer, layer_idx, span):  # the method's own scores, as the passes write them
        written[layer_idx, :, observer.first + observer.start : observer.first + observer.end] = span[0].float()
        original(observer, layer_idx, span)

    original = reconstruction.PassObserver.write
    monkeypatch.setattr(reconstruction.PassObserver, "write", write)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    expected = reference_scores(llama, prompt, prompts, chunk, sink)
    torch.testing.assert_close(written.double(), expected, atol=1e-7, rtol=2e-5)
    held = held_positions(session, reference_keys(llama, prompt))
    assert held == kept_by_definition(expected, policy.capacity, sink, policy.layerwise)
    sizes = [len(head) for heads in held.values() for head in heads]
    assert len(set(sizes)) > 1 and max(sizes) < N  # the budget shared unevenly, and compressed
    assert max(layer.keys.shape[-2] for layer in session.cache.layers) == max(sizes)  # the cache really shrunk


def test_kvgrad_generates_what_the_masked_reference_generates(llama):
    policy, prompt = CASES["chunks of 32"][0](), distinct_prompt()
    out = ec.generate(llama, prompt, policy, max_new_tokens=10)
    tokens = out.sequences[0, N:].tolist()
    kept = kept_by_definition(reference_scores(llama, prompt, TINY_RECONSTRUCTION, 32), policy.capacity)
    reference = masked_logits(llama, prompt, tokens, kept)
    assert reference.argmax(dim=-1).tolist() == tokens
    torch.testing.assert_close(out.logits[0], reference, atol=2e-4, rtol=1e-4)
    kept_sizes = [sum(len(head) for head in heads) / len(heads) for heads in kept.values()]
    assert out.stats[0]["kept_prompt_tokens"] == kept_sizes and sum(kept_sizes) == policy.capacity * len(kept)


def layer_bytes(model, tokens: int) -> int:
    config = model.config
    return 2 * config.num_key_value_heads * tokens * (config.hidden_size // config.num_attention_heads) * 4


def test_the_passes_hold_every_layers_copy_until_their_backward_pass_and_leave_the_model_as_it_was(llama):
    """Every layer holds its prompt until the passes end and, until a pass's backward pass, its copy with the pass;
    the parameters keep requires_grad and get no gradient; under inference mode too."""
    n, chunk = 150, 64
    prompt = torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(2))
    policy = ec.KVgrad(capacity=40, chunk_size=chunk).with_prompts(TINY_RECONSTRUCTION)
    with torch.inference_mode():
        session = ec.CompressionSession(llama, policy)
        session.prefill(prompt)
    longest = len(TINY_RECONSTRUCTION.next) + 8 + len(TINY_RECONSTRUCTION.suffix) + chunk
    layers = llama.config.num_hidden_layers
    assert session.realized(0)["kv_bytes_prefill_peak"] == layers * (layer_bytes(llama, n) + layer_bytes(llama, n + longest))
    assert all(p.requires_grad and p.grad is None for p in llama.parameters()) and policy.pending is None
    assert sum(len(head) for layer in ec.kept_positions(session) for head in layer) == layers * 2 * 40


def test_a_batch_keeps_what_each_prompt_keeps_alone(llama):
    from test_compression import assert_batch_equals_alone

    assert_batch_equals_alone(llama, ec.KVgrad(capacity=30, chunk_size=24).with_prompts(TINY_RECONSTRUCTION), 6)


def test_kvgrad_on_another_family_and_its_refusals_are_one_line(llama):
    qwen3 = tiny_model("qwen3")
    out = ec.generate(qwen3, distinct_prompt()[:, :60], ec.KVgrad(capacity=20, chunk_size=32)
                      .with_prompts(TINY_RECONSTRUCTION), max_new_tokens=4)
    assert sum(out.stats[0]["kept_prompt_tokens"]) == 20 * qwen3.config.num_hidden_layers
    with pytest.raises(ValueError, match="KVgrad.chunk_size must be an integer >= 1, got 0"):
        ec.KVgrad(capacity=20, chunk_size=0)
    with pytest.raises(ValueError, match="kvgrad needs the model's tokenizer for its reconstruction prompt"):
        ec.CompressionSession(llama, ec.KVgrad(capacity=20)).prefill(distinct_prompt())
    with pytest.raises(ValueError, match="prefill_chunk_mode=compress would drop tokens before kvgrad's passes"):
        ec.CompressionSession(llama, ec.KVgrad(capacity=20).with_prompts(TINY_RECONSTRUCTION)).prefill(
            distinct_prompt(), chunk=16, chunk_mode="compress")


@pytest.mark.slow
def test_the_kvgrad_paritys_evalkit_side_keeps_the_models_share(tmp_path):
    """The evalkit worker of `parity_kvgrad.py` on its random Llama (SmolLM2's tokenizer, a chat-prefixed prompt in
    chunks of 128): the whole model keeps int(n * (1 - ratio)) tokens per head on average, unevenly shared (per layer
    with layerwise), and generates its greedy tokens."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    benchmarks = Path(__file__).parents[1] / "benchmarks"
    sys.path.insert(0, str(benchmarks))
    from parity_kvgrad import CASES
    from parity_kvzip import NEW, save_models, save_prompt

    models = save_models(tmp_path)
    assert models, "SmolLM2's tokenizer is at hand in the test environment"
    save_prompt(tmp_path / "prompt.pt", AutoTokenizer.from_pretrained(models["random_llama"]), 300, chat=True)
    result = subprocess.run([sys.executable, str(benchmarks / "parity_kvgrad.py"), "--worker", "evalkit", "--model",
                             str(models["random_llama"]), "--prompt", str(tmp_path / "prompt.pt"), "--chunk", "128",
                             "--ratios", "0.5,0.75"], capture_output=True, text=True, timeout=600, cwd=benchmarks.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert {key.rsplit("@", 1)[0] for key in out["cases"]} == set(CASES)
    for key, case in out["cases"].items():
        layers, share = case["kept"], int(300 * (1 - float(key.rsplit("@", 1)[1])))
        heads = [len(head) for layer in layers for head in layer]
        assert sum(heads) == share * len(heads) and len(set(heads)) > 1, key
        if "layerwise" in key:
            assert all(sum(len(head) for head in layer) == share * len(layer) for layer in layers), key
        assert len(case["tokens"]) == NEW, key
