"""When generation stops: the model's end-of-sequence ids and stop strings (transformers' ``StopStringCriteria``, or
decoding the generated tail where a tokenizer cannot be indexed). Shared by ``generate`` and the engine."""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import StopStringCriteria


def stop_token_ids(model, tokenizer=None) -> list[int]:
    """The token ids that end a generation, as transformers' ``generate`` and vLLM stop: every id of the model's
    ``generation_config.eos_token_id`` (a list for Llama-3.1: 128001/128008/128009, Qwen3: 151645/151643; Gemma-3's
    turn end ``<end_of_turn>`` is not its tokenizer's EOS) and the tokenizer's ``eos_token_id``."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted({int(i) for i in [*ids, getattr(tokenizer, "eos_token_id", None)] if i is not None})


def eos_ids(eos_token_id) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long) if ids else None


class DecodedStop:
    """Stop strings found by decoding the generated tail, for tokenizers transformers' ``StopStringCriteria`` cannot
    index (word-level vocabularies without a prefix-space convention). Looks at generated tokens only."""

    def __init__(self, tokenizer, stop_strings: list[str], prompt_length: int):
        self.tokenizer, self.stop_strings, self.prompt_length = tokenizer, stop_strings, prompt_length
        self.window = max(len(text) for text in stop_strings) + 1  # every token holds at least one character

    def __call__(self, sequences: torch.Tensor, scores) -> torch.Tensor:
        tails = sequences[:, max(self.prompt_length, sequences.shape[1] - self.window):]
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        return torch.tensor([any(stop in text for stop in self.stop_strings) for text in texts])


def stop_criteria(tokenizer, stop_strings: str | list[str], prompt_length: int):
    stop_strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
    try:
        return StopStringCriteria(tokenizer, stop_strings)
    except ValueError:  # its vocabulary index needs a tokenizer that can spell a prefix it adds
        return DecodedStop(tokenizer, stop_strings, prompt_length)




class StopStrings:
    """The engine's stop strings: one criteria per set of strings (built once, kept across runs), and where the first
    one appears in a request's generated tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.criteria: dict[tuple[str, ...], object] = {}

    def checker(self, strings: tuple[str, ...]):
        """The criteria for ``strings`` (None: no stop strings)."""
        if not strings:
            return None
        if strings not in self.criteria:
            if self.tokenizer is None:
                raise ValueError("stop_strings need the engine's tokenizer")
            self.criteria[strings] = stop_criteria(self.tokenizer, list(strings), 0)
        return self.criteria[strings]

    def cut(self, tokens: list[int], start: int, strings: tuple[str, ...], checker) -> int | None:
        """Length of ``tokens`` once the first of ``strings`` appears among those from ``start`` on (None: none)."""
        if len(tokens) == start:
            return None
        if self.tokenizer is not None:  # quick look at the new text first; most looks find nothing
            tail = self.tokenizer.decode(tokens[max(0, start - 64) :], skip_special_tokens=True)
            if not any(s in tail for s in strings):
                return None
        for length in range(start + 1, len(tokens) + 1):
            if bool(checker(torch.tensor([tokens[:length]]), None)[0]):
                return length
        return None
