"""Prompts as the model's token ids: where a prompt's document ends, LongBench's middle truncation, and the
:class:`PromptEncoder` that applies the chat template, truncation and special tokens and counts the tokens of the
document. No torch or lm-eval at import: task code and scoring import it from here (cheaply)."""

from __future__ import annotations

from evalkit.core.errors import ConfigError

SCOPES = ("prompt", "context")
TRUNCATIONS = ("left", "middle")


def context_end(text: str, question: str | None) -> int | None:
    """Where the document of prompt ``text`` ends: where its last ``question`` starts (a task's ``doc_to_question``:
    the text that follows its document, found in the prompt as sent, chat template and truncation included), or None
    (no question given, or not in the text: cut away). With compression_scope="context" the adapter compresses only
    the text before it (question-agnostic compression); the prompt itself carries no mark."""
    question = (question or "").rstrip()  # a chat template may strip the turn's trailing whitespace
    found = text.rfind(question) if question else -1
    return found if found >= 0 else None


def truncate_middle(tokenizer, text: str, max_len: int) -> tuple[str, bool]:
    """LongBench's truncation (pred.py), on the raw prompt before any chat template: ``ids = tokenizer.encode(prompt)``
    (special tokens included, as there); if longer than ``max_len``, keep ``ids[:max_len//2] + ids[-max_len//2:]`` and
    decode with ``skip_special_tokens=True``."""
    ids = tokenizer.encode(text)
    if len(ids) <= max_len:
        return text, False
    ids = ids[: max_len // 2] + ids[-max_len // 2 :]
    return tokenizer.decode(ids, skip_special_tokens=True), True


class PromptEncoder:
    """A run's prompts as the model's token ids: the chat template (remembering each templated prompt's messages, so
    that LongBench's cut happens before the template), special tokens (never a second BOS), the
    count of tokens before where the document ends (:func:`context_end`) and truncation to the context left after
    the new tokens. Used by the lm-eval adapter for every request, and by anything that needs the run's exact ids."""

    def __init__(self, tokenizer, max_context: int, compression_scope: str = "prompt"):
        if compression_scope not in SCOPES:
            raise ValueError(f"compression_scope must be one of {SCOPES}, got {compression_scope!r}")
        self.tokenizer, self.max_context, self.compression_scope = tokenizer, int(max_context), compression_scope
        self.chats: dict[str, list[dict]] = {}  # templated prompt -> its messages (to truncate before the template)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template over ``chat_history``. A final assistant message (lm-eval's ``gen_prefix``, such as R1's
        ``<think>\\n``) is continued verbatim after the generation prompt."""
        if not getattr(self.tokenizer, "chat_template", None):  # a base model: its tasks run as plain completion
            raise ConfigError(f"{getattr(self.tokenizer, 'name_or_path', 'the model')} has no chat template (a base "
                              "model): prompt it as plain completion with model.apply_chat_template=false")
        prefix = ""
        if not add_generation_prompt and chat_history and chat_history[-1]["role"] == "assistant":
            prefix, chat_history = chat_history[-1]["content"], chat_history[:-1]
        text = self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=True) + prefix
        self.chats[text] = [dict(message) for message in chat_history] + (
            [{"role": "assistant", "content": prefix}] if prefix else [])
        return text

    def add_special_tokens(self, text: str) -> bool:
        """Whether tokenizing ``text`` should add the tokenizer's special tokens: not for chat-templated text, nor
        for text that already starts with BOS (templates such as Llama-3's write it; a second would shift every
        position)."""
        bos = self.tokenizer.bos_token
        return not (text in self.chats or (bos and text.startswith(bos)))

    def truncate_raw(self, text: str, max_len: int) -> tuple[str, bool]:
        """LongBench's middle truncation of the raw prompt (the user turn when templated), then the template."""
        messages = self.chats.get(text)
        if messages is None:
            return truncate_middle(self.tokenizer, text, max_len)
        turn = max(i for i, m in enumerate(messages) if m["role"] == "user")
        content, truncated = truncate_middle(self.tokenizer, messages[turn]["content"], max_len)
        if not truncated:
            return text, False
        messages = [*messages[:turn], {**messages[turn], "content": content}, *messages[turn + 1 :]]
        prefix = messages.pop()["content"] if messages[-1]["role"] == "assistant" else ""
        return self.apply_chat_template(messages + ([{"role": "assistant", "content": prefix}] if prefix else []),
                                        add_generation_prompt=not prefix), True

    def tokenize(self, text: str, context_end: int | None = None) -> tuple[list[int], int | None]:
        """The ids of ``text``, tokenized whole (as the official scripts send the prompt: a byte-level tokenizer
        merges across the document's end, ``</text>\\n\\nWhat``), and the number of tokens before character
        ``context_end`` (where the document ends; None: unknown): the tokens that start before it, found by character
        offsets (a token that straddles it belongs to the document). A tokenizer without offsets (a slow one) gives
        no boundary, or, where ``compression_scope=context`` needs one, is split in two pieces there."""
        special = self.add_special_tokens(text)
        if context_end is None or not (self.tokenizer.is_fast or self.compression_scope == "context"):
            return self.tokenizer(text, add_special_tokens=special)["input_ids"], None
        if not self.tokenizer.is_fast:
            ids = self.tokenizer(text[:context_end], add_special_tokens=special)["input_ids"]
            return ids + self.tokenizer(text[context_end:], add_special_tokens=False)["input_ids"], len(ids)
        encoded = self.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        text_tokens = [index for index, (start, end) in enumerate(offsets) if end > start]
        after = [index for index in text_tokens if offsets[index][0] >= context_end]
        return ids, after[0] if after else (text_tokens[-1] + 1 if text_tokens else len(ids))

    def encode(self, texts: list[str], reserve: int, truncation: str = "left", context_ends: list | None = None):
        """Left-padded ids ``[B, width]`` of ``texts`` (torch, on the CPU), their attention mask, whether each was
        cut, and, per text, where its document ends in its padded row (None: unknown). ``context_ends``: per text,
        the character where its document ends (:func:`context_end`), or None.

        A prompt longer than max_context - ``reserve`` is cut: ``left`` keeps its end, ``middle`` keeps its first and
        last halves. (LongBench's own ``max_len`` cut happens earlier, on the raw prompt: :meth:`truncate_raw`.)
        """
        import torch

        limit = self.max_context - reserve
        if limit < 1:
            raise ValueError(f"max_context {self.max_context} leaves no room for the prompt after {reserve} new tokens")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        ends = context_ends or [None] * len(texts)
        encoded, prefixes = map(list, zip(*(self.tokenize(text, end) for text, end in zip(texts, ends))))
        truncated = [len(ids) > limit for ids in encoded]
        for row, ids in enumerate(encoded):
            if not truncated[row]:
                continue
            cut = len(ids) - limit
            keep_head = limit // 2 if truncation == "middle" else 0
            encoded[row] = ids[:keep_head] + ids[keep_head + cut :]
            if prefixes[row] is not None:  # what the cut took from the document
                prefixes[row] -= min(cut, max(0, prefixes[row] - keep_head))
                prefixes[row] = prefixes[row] or None
        width = max(len(ids) for ids in encoded)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
        starts = [width - len(ids) + p if p is not None else None for ids, p in zip(encoded, prefixes)]
        return input_ids, mask, truncated, starts

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], int]:
        """The ids of ``context + continuation`` and where the continuation starts in them (log-likelihood): the
        context's own tokenization where it is a prefix of the whole, else the continuation's own length."""
        special = self.add_special_tokens(context)
        whole = self.tokenizer(context + continuation, add_special_tokens=special)["input_ids"]
        context_ids = self.tokenizer(context, add_special_tokens=special)["input_ids"]
        split = len(context_ids)
        if whole[:split] != context_ids or split >= len(whole):
            split = len(whole) - len(self.tokenizer(continuation, add_special_tokens=False)["input_ids"])
        if len(whole) > self.max_context:
            raise ValueError(f"context + continuation is {len(whole)} tokens, more than max_context {self.max_context}")
        return whole, split
