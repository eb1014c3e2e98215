"""RestoreKV against a plain float64 reading of kvpress' ``RestoreKVPress``: KVzip's kept tokens at the budget less the
restore tokens (zoo_reference.kept_kvzip), the restore tokens' keys and values from a float64 copy of the model with
the LoRA adapter merged into its weights (``W + scaling * B A``) run once over the whole prompt's cache at the
positions after it, and the tokens generated from a full float64 cache hiding what was dropped (the base weights, the
restore tokens visible, decoding after them). The cache really holds ``capacity`` slots per layer and head on
average. kvpress itself, with PEFT applying the same files: benchmarks/parity_restorekv.py."""

from __future__ import annotations

import copy

import pytest
import torch
import zoo_reference as ref
from conftest import TINY_RECONSTRUCTION, random_prompt, tiny_model
from learned_files import copy_of, restorekv
from masked_reference import module_scaling
from safetensors.torch import load_file
from test_zoo_methods import KVZIP_PROMPTS, N, distinct_prompt
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

import evalkit.compression as ec
from evalkit.compression.learned_weights import LearnedFileError
from evalkit.compression.model_spec import cache_kwargs

CAPACITY, TOKENS, NEW = 30, 4, 12
VISIBLE: dict[int, torch.Tensor] = {}  # per layer, the keys each KV head sees [Hkv, keys] (the reference's decoding)


def _reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """One decode step in float64, each KV head's group seeing only its ``VISIBLE`` keys."""
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, dim=1).double(), value.repeat_interleave(group, dim=1).double()
    logits = query.double() @ keys.transpose(-1, -2) * scaling
    visible = VISIBLE[module.layer_idx].repeat_interleave(group, dim=0)[None, :, None, :]
    output = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ values
    return output.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("restorekv_reference", _reference_attention)
AttentionMaskInterface.register("restorekv_reference", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def merged(model, folder, scaling: float):
    """A float64 copy of ``model`` with the adapter's ``scaling * B @ A`` added to each target's weight."""
    merged_model = copy.deepcopy(model).double()
    for key, down in load_file(str(folder / "adapter_model.safetensors")).items():
        if ".lora_A." in key:
            path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            up = load_file(str(folder / "adapter_model.safetensors"))[key.replace("lora_A", "lora_B")]
            merged_model.get_submodule(path).weight.data += scaling * up.double() @ down.double()
    return merged_model


@torch.no_grad()
def reference(model, prompt, folder, scaling: float, held: dict, tokens: list[int]):
    """The restore keys and values per layer ``[Hkv, TOKENS, D]`` and the logits of the prefill and of each of
    ``tokens`` fed after the restore tokens, every layer and head seeing the prompt positions ``held`` names."""
    base, n = copy.deepcopy(model).double(), prompt.shape[1]
    cache = DynamicCache(config=base.config)
    logits = [base(input_ids=prompt, **cache_kwargs(base, cache), use_cache=True).logits[0, -1]]
    embeddings = load_file(str(folder / "restore_embeddings.safetensors"))["restore_embeddings"].double()
    adapted = merged(model, folder, scaling)
    adapted.model(inputs_embeds=embeddings[None], **cache_kwargs(adapted.model, cache), use_cache=True,
                  position_ids=n + torch.arange(TOKENS)[None])
    restore = [(layer.keys[0, :, n:].clone(), layer.values[0, :, n:].clone()) for layer in cache.layers]
    base.config._attn_implementation = "restorekv_reference"
    for step, token in enumerate(tokens):
        total = n + TOKENS + step + 1
        for layer, heads in held.items():
            VISIBLE[layer] = torch.stack([torch.tensor([j in head or j >= n for j in range(total)]) for head in heads])
        out = base(input_ids=torch.tensor([[token]]), **cache_kwargs(base, cache), use_cache=True,
                   position_ids=torch.tensor([[total - 1]]))
        logits.append(out.logits[0, -1])
    return restore, torch.stack(logits)


def held_by(session, row: int = 0) -> dict[int, list[set[int]]]:
    return {index: [set(p[v].tolist()) for p, v in zip(layer.heads.positions[row], layer.heads.valid[row])]
            for index, layer in enumerate(session.cache.layers)}


def restore_slots(layer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's restore keys and values ``[Hkv, TOKENS, D]`` (row 0), by position."""
    order = [[int(s) for s in p.argsort() if p[s] >= n] for p in layer.heads.positions[0]]
    return (torch.stack([layer.keys[0, h, slots] for h, slots in enumerate(order)]),
            torch.stack([layer.values[0, h, slots] for h, slots in enumerate(order)]))


CASES = {  # case: (method, its settings, kept_kvzip's)
    "restorekv": (ec.RestoreKV, {"chunk_size": 32}, {}),
    "restorekv layerwise, sink 2": (ec.RestoreKV, {"chunk_size": 50, "sink": 2, "layerwise": True},
                                    {"sink": 2, "layerwise": True}),
    "restorekv_plus": (ec.RestoreKVPlus, {"chunk_size": 32}, {"plus": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kept_tokens_restore_slots_and_outputs_follow_the_plain_definition(case):
    method, settings, kvzip = CASES[case]
    model, prompt, folder = tiny_model(), distinct_prompt(), restorekv(tokens=TOKENS)
    policy = method(capacity=CAPACITY, adapter=str(folder), **settings).with_prompts(KVZIP_PROMPTS)
    chunk = settings["chunk_size"]
    expected = ref.kept_kvzip(model, prompt, CAPACITY - TOKENS, KVZIP_PROMPTS, chunk, module_scaling(model), **kvzip)
    restore_positions = set(range(N, N + TOKENS))
    session = ec.CompressionSession(model, policy)
    session.prefill(prompt)
    held = held_by(session)
    assert held == {layer: [heads | restore_positions for heads in per_head] for layer, per_head in expected.items()}
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    valid = torch.stack([layer.heads.valid[0] for layer in session.cache.layers])  # the cache's own slots
    assert int(valid.sum()) == layers * kv_heads * CAPACITY < layers * kv_heads * N  # it compressed, to budget
    assert max(layer.keys.shape[2] for layer in session.cache.layers) < N
    out = ec.generate(model, prompt, policy, max_new_tokens=NEW)
    tokens = out.sequences[0, N:].tolist()
    restore, logits = reference(model, prompt, folder, 8.0 / 4, expected, tokens[:-1])
    for layer, (keys, values) in zip(session.cache.layers, restore):
        ours = restore_slots(layer, N)
        torch.testing.assert_close(ours[0].double(), keys, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ours[1].double(), values, atol=2e-5, rtol=1e-5)
    assert logits.argmax(dim=-1).tolist() == tokens
    torch.testing.assert_close(out.logits[0].double(), logits, atol=1e-4, rtol=1e-4)


def test_the_adapter_changes_the_restore_tokens_and_is_gone_after_their_pass():
    """Without its LoRA the restore tokens' keys differ (the reference above would catch a missing adapter), and no
    hook is left on the model after the prefill."""
    model, prompt, folder = tiny_model(), distinct_prompt(), restorekv(tokens=TOKENS)
    session = ec.CompressionSession(model, ec.RestoreKV(capacity=CAPACITY, chunk_size=32, adapter=str(folder))
                                    .with_prompts(KVZIP_PROMPTS))
    session.prefill(prompt)
    plain, _ = reference(model, prompt, folder, 0.0, {}, [])
    assert float((restore_slots(session.cache.layers[1], N)[0].double() - plain[1][0]).abs().max()) > 1e-2
    assert not any(module._forward_hooks for module in model.modules())
    assert int(session.state.seq_len[0]) == N + TOKENS  # decoding goes on after the restore tokens


def test_a_batch_keeps_what_each_prompt_keeps_alone_and_a_prompt_that_fits_is_kept_whole():
    model = tiny_model()
    policy = ec.RestoreKV(capacity=40, chunk_size=32, adapter=str(restorekv(tokens=TOKENS))) \
        .with_prompts(TINY_RECONSTRUCTION)
    short, long = random_prompt(35, seed=2), random_prompt(90, seed=3)
    batch = torch.cat([torch.nn.functional.pad(short, (55, 0)), long])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(short), (55, 0)), torch.ones_like(long)])
    together = ec.generate(model, batch, policy, attention_mask=mask, max_new_tokens=6)
    alone = [ec.generate(model, prompt, policy, max_new_tokens=6) for prompt in (short, long)]
    for row, out in enumerate(alone):
        assert together.sequences[row, -6:].tolist() == out.sequences[0, -6:].tolist()
        assert together.stats[row]["kept_prompt_tokens_per_head"] == out.stats[0]["kept_prompt_tokens_per_head"]
    assert alone[0].stats[0]["kept_prompt_tokens"] == [35, 35]  # whole, no restore token
    assert alone[1].stats[0]["kept_prompt_tokens"] != [40, 40] and sum(alone[1].stats[0]["kept_prompt_tokens"]) == 80
    full = ec.generate(model, short, ec.Full(), max_new_tokens=6)
    assert alone[0].sequences.tolist() == full.sequences.tolist()


def damaged(name: str, text: str | None = None):
    folder = copy_of(restorekv(tokens=TOKENS))
    if text is None:
        (folder / name).unlink()
    else:
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize("folder, message", [
    (lambda: damaged("adapter_model.safetensors"), r"has no adapter_model\.safetensors$"),
    (lambda: damaged("restore_embeddings.safetensors"), r"has no restore_embeddings\.safetensors$"),
    (lambda: damaged("adapter_config.json", '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": true}'),
     r"use_dora is True; evalkit applies plain LoRA adapters only"),
    (lambda: damaged("adapter_config.json", '{"peft_type": "LORA", "r": 8, "lora_alpha": 8}'),
     r"mlp\.down_proj: lora_A \[4, 96\] and lora_B \[64, 4\] must be \[r, in\] and \[out, r\] with r = 8"),
    (lambda: damaged("adapter_config.json", '{"peft_type": "IA3"}'), r"peft_type is 'IA3'"),
])
def test_damaged_adapter_files_are_refused_in_one_line_as_the_method_is_built(folder, message):
    with pytest.raises(LearnedFileError, match=message) as error:
        ec.RestoreKV(capacity=CAPACITY, adapter=str(folder()))
    assert "\n" not in str(error.value)


def test_an_adapter_for_another_model_or_too_small_a_capacity_is_refused_in_one_line():
    prompt = random_prompt(60)
    wider = ec.RestoreKV(capacity=20, adapter=str(restorekv(hidden=32))).with_prompts(TINY_RECONSTRUCTION)
    with pytest.raises(LearnedFileError, match=r"embeddings of width 32, the model's are 64 wide$"):
        ec.CompressionSession(tiny_model(), wider).prefill(prompt)
    other = ec.RestoreKV(capacity=20, adapter=str(restorekv(heads=8))).with_prompts(TINY_RECONSTRUCTION)
    with pytest.raises(LearnedFileError, match=r"adapts model\.layers\.0\.mlp\.down_proj as 96 -> 64 features|"
                                               r"adapts model\.layers\.0\.self_attn\.o_proj as 128 -> 64 features"):
        ec.CompressionSession(tiny_model(), other).prefill(prompt)
    deeper = ec.RestoreKV(capacity=20, adapter=str(restorekv(layers=3))).with_prompts(TINY_RECONSTRUCTION)
    with pytest.raises(LearnedFileError, match=r"adapts model\.layers\.2\.\S+, which the model has not$"):
        ec.CompressionSession(tiny_model(), deeper).prefill(prompt)
    small = ec.RestoreKV(capacity=TOKENS, adapter=str(restorekv(tokens=TOKENS))).with_prompts(TINY_RECONSTRUCTION)
    with pytest.raises(ValueError, match="capacity 4 leaves no room beside its 4 restore tokens"):
        ec.CompressionSession(tiny_model(), small).prefill(prompt)


def test_the_parity_scripts_evalkit_side_keeps_the_budget_with_its_restore_slots():
    """benchmarks/parity_restorekv.py's evalkit side (kvpress' beside it there): every case holds ``capacity`` slots
    per layer and head on average, the restore tokens' positions in every head."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from parity_restorekv import CASES as PARITY
    from parity_restorekv import N as LENGTH
    from parity_restorekv import run_evalkit

    adapters = {case: str(restorekv(tokens=tokens, seed=index))
                for index, (case, (*_, tokens, _)) in enumerate(PARITY.items())}
    ours = run_evalkit(tiny_model(), adapters, TINY_RECONSTRUCTION)
    for case, (_, _, ratio, tokens, _) in PARITY.items():
        kept = [head for layer in ours[case]["kept"] for head in layer]
        assert sum(map(len, kept)) == len(kept) * int(LENGTH * (1 - ratio))
        assert all(set(range(LENGTH, LENGTH + tokens)) <= set(head) for head in kept)
        assert torch.tensor(ours[case]["keys"]).shape[-2] == tokens and len(ours[case]["tokens"]) == 32
