"""Speculative prefill: exactness at keep=1, original positions, cross-tokenizer importance mapping, selection."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import evalkit.compression as ec
from evalkit.models import synthetic
from evalkit.models.train_tiny import build_tokenizer


@pytest.fixture(scope="module")
def word_model(random_model_dir):
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, attn_implementation="sdpa").eval()
    return model, build_tokenizer()


def prompt_text(seed: int = 5, pairs: int = 30) -> str:
    example = synthetic.make_example(random.Random(seed), pairs, 0.3)
    return f"{example['context']} {example['question']}"


def test_keep_all_reproduces_the_full_run_exactly(word_model):
    model, tokenizer = word_model
    spec = ec.SpecPrefill(draft=model, draft_tokenizer=tokenizer, keep=1.0, chunk_size=8, look_ahead_cnt=3)
    texts = [prompt_text(1), prompt_text(2, pairs=20)]
    ids, mask, positions, stats = spec.select(texts, tokenizer, tokenizer.pad_token_id)
    assert [s["kept_tokens"] for s in stats] == [s["prompt_tokens"] for s in stats]
    plain = tokenizer(texts, padding=True, return_tensors="pt")
    assert torch.equal(ids, plain["input_ids"]) and torch.equal(mask, plain["attention_mask"])
    spec_out = ec.generate(model, ids, ec.Full(), attention_mask=mask, position_ids=positions, max_new_tokens=6)
    full_out = ec.generate(model, plain["input_ids"], ec.Full(), attention_mask=plain["attention_mask"], max_new_tokens=6)
    assert torch.equal(spec_out.sequences, full_out.sequences)
    torch.testing.assert_close(spec_out.logits, full_out.logits, atol=1e-5, rtol=1e-5)


def test_kept_tokens_keep_their_original_positions(word_model):
    """Prefilling only the kept tokens equals a full run whose attention masks the dropped ones (same positions)."""
    model, tokenizer = word_model
    spec = ec.SpecPrefill(draft=model, draft_tokenizer=tokenizer, keep=0.3, chunk_size=4, look_ahead_cnt=3, tail=4, keep_first=True)
    ids, mask, positions, stats = spec.select([prompt_text(3)], tokenizer, tokenizer.pad_token_id)
    whole = torch.tensor([tokenizer(prompt_text(3))["input_ids"]])
    n = whole.shape[1]
    assert stats[0]["prompt_tokens"] == n and stats[0]["kept_tokens"] < n / 2
    kept = positions[0]
    assert kept[-4:].tolist() == list(range(n - 4, n)) and kept[0] == 0 and torch.equal(whole[0, kept], ids[0])
    session = ec.CompressionSession(model, ec.Full())
    ours = session.prefill(ids, mask, positions)
    visible = torch.zeros(1, n, dtype=torch.long)
    visible[0, kept] = 1
    with torch.no_grad():
        reference = model(input_ids=whole, attention_mask=visible, position_ids=torch.arange(n)[None]).logits[:, -1]
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    # The next token is placed at position n, not at the number of kept tokens.
    token = ours.argmax(-1, keepdim=True)
    step = session.step(token)[:, -1]
    with torch.no_grad():
        longer = torch.cat([whole, token], dim=1)
        reference_step = model(input_ids=longer, attention_mask=torch.cat([visible, torch.ones(1, 1, dtype=torch.long)], 1),
                               position_ids=torch.arange(n + 1)[None]).logits[:, -1]
    torch.testing.assert_close(step, reference_step, atol=1e-4, rtol=1e-4)


def char_tokenizer(text: str) -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1}
    for char in sorted(set(text)):
        vocab.setdefault(char, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")


def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1, "al": 2, "##pha": 3, "beta": 4, "gam": 5, "##ma": 6, "delta": 7}
    core = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")


def test_cross_tokenizer_importance_follows_the_characters():
    text = "alpha beta gamma delta"
    chars, pieces = char_tokenizer(text), wordpiece_tokenizer()
    torch.manual_seed(0)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=len(chars), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()
    spec = ec.SpecPrefill(draft=draft, draft_tokenizer=chars, keep=0.5, chunk_size=None, look_ahead_cnt=4, pool_kernel=None)
    target_ids, mapped = spec.target_importance(text, pieces)
    assert pieces.convert_ids_to_tokens(target_ids) == ["al", "##pha", "beta", "gam", "##ma", "delta"]
    # Independently: each target piece's characters, and the draft's importance of those characters.
    draft_importance = spec.draft_importance(torch.tensor(chars(text)["input_ids"]))
    spans = pieces(text, return_offsets_mapping=True)["offset_mapping"]
    expected = [max(float(draft_importance[i]) for i in range(start, end)) for start, end in spans]
    torch.testing.assert_close(mapped, torch.tensor(expected))


def test_mapping_gives_each_target_token_its_overlapping_draft_tokens():
    # Draft: "ab|cd|ef" with importance 1, 5, 2; target: "a|bcd|ef" -> max over overlaps.
    mapped = ec.map_by_characters([(0, 0), (0, 2), (2, 4), (4, 6)], torch.tensor([9.0, 1.0, 5.0, 2.0]),
                                  [(0, 1), (1, 4), (4, 6), (0, 0)])
    assert mapped.tolist() == [1.0, 5.0, 2.0, 9.0]  # special token (no characters): the maximum, never dropped


def test_choose_keeps_whole_top_chunks_and_forces_nothing_by_default():
    # The reference: 70 tokens in chunks of 32, 32 and 6; ceil(3 x 0.1) = 1 whole chunk, the best by mean score.
    spec = ec.SpecPrefill(draft=None, draft_tokenizer=None, keep=0.1, chunk_size=32)
    importance = torch.zeros(70)
    importance[64:] = 1.0  # the short last chunk has the best mean
    assert spec.choose(importance).tolist() == list(range(64, 70))  # token 0 is not forced
    spec = ec.SpecPrefill(draft=None, draft_tokenizer=None, keep=0.1, chunk_size=None)
    importance = torch.arange(70, dtype=torch.float)
    assert spec.choose(importance).tolist() == list(range(63, 70))  # ceil(70 x 0.1) = 7 single tokens


def test_choose_options_force_the_tail_and_the_first_token():
    spec = ec.SpecPrefill(draft=None, draft_tokenizer=None, keep=0.375, chunk_size=4, tail=2, keep_first=True)
    importance = torch.zeros(32)
    importance[8:12] = 1.0  # chunk 2 is the important one
    kept = spec.choose(importance).tolist()  # ceil(8 x 0.375) = 3 chunks: the forced first and last, then chunk 2
    assert kept == [0, 1, 2, 3, 8, 9, 10, 11, 28, 29, 30, 31]


def one_head_draft(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def test_lookahead_queries_softmax_over_the_prompt_keys_only():
    # One layer, one head, no pooling: the importance is the mean of the queries' attention rows over the prompt. The
    # reference takes each softmax over the prompt keys alone, so every row, and their mean, sums to exactly 1 (a
    # softmax over all keys would leave look-ahead rows short of 1 by the attention on earlier look-ahead tokens).
    draft, ids = one_head_draft(), torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(1))
    spec = ec.SpecPrefill(draft=draft, draft_tokenizer=None, look_ahead_cnt=6, pool_kernel=None)
    assert float(spec.draft_importance(ids).sum()) == pytest.approx(1.0, abs=1e-5)


def test_pooling_counts_padding_as_the_reference():
    draft, ids = one_head_draft(), torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(2))
    raw = ec.SpecPrefill(draft=draft, draft_tokenizer=None, look_ahead_cnt=4, pool_kernel=None).draft_importance(ids)
    pooled = ec.SpecPrefill(draft=draft, draft_tokenizer=None, look_ahead_cnt=4, pool_kernel=5).draft_importance(ids)
    expected = torch.nn.functional.avg_pool1d(raw[None, None], 5, stride=1, padding=2, count_include_pad=True)[0, 0]
    torch.testing.assert_close(pooled, expected)
    assert float(pooled.sum()) < 1.0  # the padding's zeros count at the edges


def test_lookahead_stops_at_eos():
    draft, ids = one_head_draft(), torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(3))
    first = int(draft(ids[None]).logits[0, -1].argmax())
    draft.generation_config.eos_token_id = first  # the first look-ahead token is EOS: only the prompt's query counts
    stopped = ec.SpecPrefill(draft=draft, draft_tokenizer=None, look_ahead_cnt=8, pool_kernel=None).draft_importance(ids)
    single = ec.SpecPrefill(draft=draft, draft_tokenizer=None, look_ahead_cnt=1, pool_kernel=None).draft_importance(ids)
    torch.testing.assert_close(stopped, single)
    draft.generation_config.eos_token_id = None
    assert not torch.allclose(
        ec.SpecPrefill(draft=draft, draft_tokenizer=None, look_ahead_cnt=8, pool_kernel=None).draft_importance(ids), single)


@pytest.mark.parametrize("kwargs, message", [({"keep": 0}, "keep"), ({"chunk_size": 0}, "chunk_size"),
                                             ({"pool_kernel": 4}, "pool_kernel"), ({"look_ahead_cnt": 0}, "look_ahead_cnt")])
def test_bad_spec_prefill_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ec.SpecPrefill(draft=None, draft_tokenizer=None, **kwargs)


def test_a_qwen_target_with_a_llama_draft_runs_end_to_end():
    text = "alpha beta gamma delta " * 6
    chars, pieces = char_tokenizer(text), wordpiece_tokenizer()
    torch.manual_seed(1)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=len(chars), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()
    target = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(pieces), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()
    spec = ec.SpecPrefill(draft=draft, draft_tokenizer=chars, keep=0.3, chunk_size=2, look_ahead_cnt=3, tail=3, keep_first=True)
    ids, mask, positions, stats = spec.select([text], pieces, pieces.pad_token_id)
    out = ec.generate(target, ids, ec.Full(), attention_mask=mask, position_ids=positions, max_new_tokens=3)
    assert stats[0]["kept_tokens"] < stats[0]["prompt_tokens"] == 36
    assert out.sequences.shape == (1, ids.shape[1] + 3) and int(positions.max()) == 35


@pytest.mark.slow
def test_spec_prefill_through_the_cli_records_its_work(tmp_path, random_model_dir):
    from helpers import evalkit

    from evalkit.results import read_table

    results = tmp_path / "results"
    result = evalkit("task=kv_retrieval", "method=spec_prefill", f"method.draft_model={random_model_dir}",
                     "method.then=snapstream", "+budget=4x", "method.keep=0.2", "method.tail=8", "limit=4",
                     f"model.pretrained={random_model_dir}", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    samples = read_table(results, "samples")
    assert (samples["method"] == "spec_prefill").all() and (samples["decode_method"] == "snapstream").all()
    assert (samples["draft_model"] == str(random_model_dir)).all() and (samples["keep_fraction"] == 0.2).all()
    assert (samples["spec_kept_tokens"] < samples["prompt_tokens"] * 0.35).all()
    assert samples["draft_seconds"].gt(0).all() and samples["prefill_seconds"].gt(0).all()


def test_spec_prefill_without_a_draft_is_a_config_error():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from evalkit.core.paths import conf_dir
    from evalkit.run import ConfigError, validate

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=["method=spec_prefill"]), resolve=True)
    with pytest.raises(ConfigError, match="needs method.draft_model"):
        validate(cfg)
    cfg["method"]["draft_model"] = "x"
    cfg["method"]["then"] = "snapkv"
    with pytest.raises(ConfigError, match="method=snapkv needs a budget"):
        validate(cfg)
