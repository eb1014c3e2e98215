"""The PromptEncoder alone, with a tokenizer and no model: where the document's end (given out of band, as a
character position) falls in the tokens, how each truncation moves it, and no second BOS before a templated or
BOS-led prompt."""

from __future__ import annotations

import pytest

from evalkit.lm.prompts import PromptEncoder, context_end
from evalkit.models.train_tiny import build_tokenizer

DOCUMENT = " ".join(f"k{i} v{i % 7}" for i in range(30))  # 60 words: 60 tokens with the tiny word-level tokenizer
QUESTION = "? k3"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_the_tokens_before_the_documents_end_are_counted(tokenizer):
    encoder = PromptEncoder(tokenizer, max_context=512)
    text = DOCUMENT + " " + QUESTION
    assert context_end(text, " " + QUESTION) == len(DOCUMENT)
    ids, before = encoder.tokenize(text, context_end(text, " " + QUESTION))
    assert ids == tokenizer(DOCUMENT + " " + QUESTION)["input_ids"]
    assert ids[before:] == tokenizer(" " + QUESTION, add_special_tokens=False)["input_ids"]
    assert encoder.tokenize(text)[1] is None  # no end given, no boundary
    assert context_end(text, "? k4") is None and context_end(text, None) is None  # not in the prompt: unknown


@pytest.mark.parametrize("truncation", ["left", "middle"])
def test_truncation_keeps_the_limit_and_moves_the_context_end_with_the_cut(tokenizer, truncation):
    text = DOCUMENT + " " + QUESTION
    whole, before = PromptEncoder(tokenizer, max_context=512).tokenize(text, len(DOCUMENT))
    encoder = PromptEncoder(tokenizer, max_context=40)
    ids, mask, (truncated,), (start,) = encoder.encode([text], reserve=8, truncation=truncation,
                                                       context_ends=[len(DOCUMENT)])
    kept = ids[0].tolist()
    assert truncated and len(kept) == 32 and mask.sum() == 32
    cut = len(whole) - 32
    if truncation == "left":  # the end survives: the question and the document's last tokens
        assert kept == whole[cut:] and start == before - cut
    else:  # the first and last halves survive
        assert kept == whole[:16] + whole[16 + cut:] and start == before - cut
    assert kept[start:] == whole[before:]  # the question is still after the document's end


def test_a_short_prompt_is_left_padded_beside_a_long_one(tokenizer):
    encoder = PromptEncoder(tokenizer, max_context=512)
    ids, mask, truncated, starts = encoder.encode(["k1 v2 ? k1", DOCUMENT], reserve=4, context_ends=[5, None])
    assert truncated == [False, False]
    assert mask[0].tolist() == [0] * (ids.shape[1] - 5) + [1] * 5
    assert ids[0, -5:].tolist() == tokenizer("k1 v2 ? k1")["input_ids"] and starts == [ids.shape[1] - 2, None]  # BOS k1 v2 | ? k1


def test_no_room_for_the_prompt_and_an_unknown_truncation_are_refused(tokenizer):
    encoder = PromptEncoder(tokenizer, max_context=16)
    with pytest.raises(ValueError, match="leaves no room for the prompt after 16 new tokens"):
        encoder.encode(["k1"], reserve=16)
    with pytest.raises(ValueError, match="truncation must be one of"):
        encoder.encode(["k1"], reserve=4, truncation="right")
    with pytest.raises(ValueError, match="compression_scope must be one of"):
        PromptEncoder(tokenizer, 16, "document")


def test_templated_or_bos_led_text_gets_no_second_bos(tokenizer):
    encoder = PromptEncoder(tokenizer, max_context=512)
    bos = tokenizer.bos_token
    assert encoder.add_special_tokens("k1 v2")
    assert bos is None or not encoder.add_special_tokens(bos + " k1 v2")
    encoder.chats["templated k1"] = [{"role": "user", "content": "k1"}]  # what apply_chat_template remembers
    assert not encoder.add_special_tokens("templated k1")


def test_a_pair_splits_where_the_continuation_starts(tokenizer):
    ids, split = PromptEncoder(tokenizer, max_context=512).encode_pair("k1 v2 ? k1", " v2")
    assert ids[split:] == tokenizer(" v2", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="more than max_context 3"):
        PromptEncoder(tokenizer, max_context=3).encode_pair("k1 v2 ? k1", " v2")
