"""The shipped tiny model on the built-in task: a full cache answers, and compression moves the score as it must.

The answer's second token is decoded from the compressed cache, so the score depends on whether the needle survived:
StreamingLLM's recent window only holds late needles, SnapKV's observation window (which holds the question) keeps it.
"""

from __future__ import annotations

import pytest

from evalkit.config import compose as compose_config
from evalkit.models import ASSETS
from evalkit.run import run, validate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ASSETS / "kv_retrieval_tiny" / "config.json").is_file(), reason="built-in model not shipped"),
]


@pytest.fixture(scope="module")
def scores(tmp_path_factory):
    """exact_match per subset for the full cache and three compressed runs, all on the same 60 prompts."""
    results_dir = tmp_path_factory.mktemp("known_answer")
    runs = {"full": [], "streaming_llm": ["+budget=4x", "method=streaming_llm"],
            "snapkv": ["+budget=4x", "method=snapkv"], "snapstream": ["+budget=4x", "method=snapstream"]}
    out = {}
    for name, overrides in runs.items():
        cfg = compose_config(*overrides, "limit=60", f"results_dir={results_dir}", "device=cpu")
        spec = validate(cfg, method_explicit=name != "full")
        metrics = run(spec).metrics
        exact = metrics[metrics["metric"] == "exact_match"].set_index("subset")["value"]
        out[name] = exact.to_dict()
    return out


def test_full_cache_scores_at_least_95_percent(scores):
    assert scores["full"]["all"] >= 0.95


def test_streaming_window_loses_needles_it_cannot_see(scores):
    streaming = scores["streaming_llm"]
    assert streaming["depth_early"] <= 0.2 and streaming["depth_middle"] <= 0.2
    assert streaming["all"] <= scores["full"]["all"] - 0.4
    assert streaming["depth_late"] > streaming["depth_early"]  # the recent window still holds late needles


def test_snapkv_keeps_most_needles(scores):
    assert scores["snapkv"]["all"] >= 0.7
    assert scores["snapkv"]["all"] >= scores["streaming_llm"]["all"] + 0.3
    assert min(scores["snapkv"][s] for s in ("depth_early", "depth_middle")) >= 0.5  # wherever the needle is


def test_snapstream_is_between_streaming_and_snapkv(scores):
    # Same 64 slots, but a quarter of them wait for generated tokens: 12 selected prompt tokens instead of 32.
    assert scores["streaming_llm"]["all"] < scores["snapstream"]["all"] <= scores["snapkv"]["all"]
    assert scores["snapstream"]["depth_early"] >= scores["streaming_llm"]["depth_early"] + 0.2


def test_spec_prefill_with_the_tiny_model_as_draft_keeps_the_needle():
    import evalkit.compression as ec
    from evalkit.models import load_model, synthetic

    model, tokenizer = load_model("builtin:kv_retrieval_tiny", device="cpu")
    spec = ec.SpecPrefill(draft=model, draft_tokenizer=tokenizer, keep=0.1, chunk_size=None, look_ahead_cnt=2, tail=2, keep_first=True)
    rows = synthetic.build_examples(40, seed=99)
    kept_needles = correct = 0
    for row in rows:
        text = f"{row['context']} {row['question']}"
        ids, mask, positions, stats = spec.select([text], tokenizer, tokenizer.pad_token_id)
        assert stats[0]["kept_tokens"] <= 0.1 * stats[0]["prompt_tokens"] + 3
        entry = 1 + 3 * row["needle_index"]  # after <s>: u v k per entry
        kept_needles += {entry, entry + 1, entry + 2} <= set(positions[0].tolist())
        out = ec.generate(model, ids, ec.Full(), attention_mask=mask, position_ids=positions, max_new_tokens=3,
                          eos_token_id=tokenizer.eos_token_id)
        answer = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
        correct += synthetic.first_words(answer) == row["answer"]
    assert kept_needles >= 0.9 * len(rows)
    assert correct >= 0.8 * len(rows)
