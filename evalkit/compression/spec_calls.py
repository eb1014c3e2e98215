"""Speculative prefill inside the agent loop: a draft model (any family) reads a session's calls as they come, on top
of its own cache, and picks the tokens of each call's new content that the target prefills (:mod:`.agent_calls`,
``generate_calls(draft=)``; the rules of :mod:`.spec_prefill`).

At each call the draft reads what is NEW: the answer the conversation kept (the target's, or the gold one), the
call's new content and its question. Its cache carries over from call to call, so it never reads the history again.
Its look-ahead queries (the question's last token, then up to ``look_ahead_cnt - 1`` tokens it decodes greedily,
stopping at its EOS) score what it has read with SpecPrefill's rules: each query's attention a softmax over the keys
read so far (the look-ahead tokens excluded), pooled along them (``pool_kernel``), max over layers x heads, mean over
the queries; the call's new content then keeps its top ``ceil(chunks x keep)`` whole chunks (``tail`` and
``keep_first`` as SpecPrefill's, on the new content). The look-ahead tokens are cut from the draft's cache again. The
first call's new content is the session's context; the question, and the answer before it, are never dropped.

The draft reads TEXT (:class:`CallText`: the call's text and where the target's tokens lie in it; the answers decoded
by the target's tokenizer), tokenized by its own tokenizer, and the importance of its tokens reaches the target's
through characters (:func:`~.spec_prefill.map_by_characters`): draft and target may be of different families.

    draft = ec.SpecCalls(ec.SpecPrefill(draft_model, draft_tokenizer, keep=0.25), tokenizer, texts)
    out = ec.generate_calls(model, context_ids, calls, ec.Full(), draft=draft)
    out.stats[1]["spec_kept_tokens"], out.stats[1]["draft_seconds"], draft.kept[1]
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .attention import attention_implementation
from .model_spec import cache_kwargs, layer_kinds, returned_cache
from .spec_prefill import SpecPrefill, _prompt_attention, map_by_characters
from .stopping import stop_token_ids


@dataclasses.dataclass(frozen=True)
class CallText:
    """One call as text: ``text`` (its new content, then its question; the first call's: the context, then its
    question), ``offsets`` (each of the target's tokens of ``text``: its ``(start, end)`` characters, as a fast
    tokenizer's offset mapping gives them) and ``content`` (how many of those tokens, the first, are new content)."""

    text: str
    offsets: list
    content: int

    def __post_init__(self):
        if not 0 <= self.content <= len(self.offsets):
            raise ValueError(f"a call's content is some of its {len(self.offsets)} tokens, got {self.content}")


def call_text(tokenizer, text: str, content_end: int, add_special_tokens: bool = False) -> tuple[list[int], CallText]:
    """``text`` tokenized by the target's (fast) ``tokenizer``, and as a :class:`CallText` whose new content is the
    tokens that start before character ``content_end``."""
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    offsets = [tuple(span) for span in encoded["offset_mapping"]]
    content = next((i for i, (start, end) in enumerate(offsets) if end > start and start >= content_end), len(offsets))
    return encoded["input_ids"], CallText(text, offsets, content)


class SpecCalls:
    """The draft of one session (see the module's docstring): ``spec`` holds the draft model, its tokenizer and the
    selection's settings; ``tokenizer`` is the target's; ``calls`` the session's calls as text, in order. ``kept[i]``:
    the indices of call ``i``'s new content (the context for call 0) that the target prefills."""

    def __init__(self, spec: SpecPrefill, tokenizer, calls: list[CallText]):
        if not calls or not all(isinstance(call, CallText) for call in calls):
            raise ValueError("SpecCalls takes a session's calls as a non-empty list of CallText")
        if "sliding_attention" in layer_kinds(spec.draft.config):
            raise ValueError(f"a draft with sliding-window layers ({type(spec.draft).__name__}) forgets what left its "
                             "window, so it cannot read a session call by call; use a draft whose layers all attend "
                             "fully (SmolLM2, Llama, Qwen)")
        self.spec, self.tokenizer, self.calls = spec, tokenizer, list(calls)
        self.eos = set(stop_token_ids(spec.draft, spec.draft_tokenizer))
        self.cache, self.read, self.kept = None, 0, []

    @torch.no_grad()
    def choose(self, turn: int, said: torch.Tensor | None, content_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Call ``turn``'s kept content indices (sorted, into ``content_ids``: the target's ids of its new content),
        once the draft has read ``said`` (the target's ids of what the conversation kept since the last call: its
        answer; None on the first call) and the call. Returns them and the call's ``spec_kept_tokens``,
        ``draft_seconds``, ``draft_tokens_computed`` (the tokens the draft read) and ``draft_look_ahead_tokens``."""
        started = time.perf_counter()
        call = self._call(turn, content_ids)
        said_text = self.tokenizer.decode(said.tolist()) if said is not None and len(said) else ""
        encoded = self.spec.draft_tokenizer(said_text + call.text, add_special_tokens=turn == 0,
                                            return_offsets_mapping=True)
        ids, begin = encoded["input_ids"], self.read
        rows = self._read(ids, score=call.content > 0)
        kept = torch.zeros(0, dtype=torch.long)
        if call.content:
            importance = self.spec.pooled(rows)[begin:]
            shift = len(said_text)
            mapped = map_by_characters(encoded["offset_mapping"], importance,
                                       [(start + shift, end + shift) for start, end in call.offsets[: call.content]])
            kept = self.spec.choose(mapped)
        self.kept.append(kept.tolist())
        return kept, {"spec_kept_tokens": len(kept), "draft_seconds": time.perf_counter() - started,
                      "draft_tokens_computed": len(ids), "draft_look_ahead_tokens": 0 if rows is None else len(rows) - 1}

    def _call(self, turn: int, content_ids: torch.Tensor) -> CallText:
        if turn != len(self.kept) or turn >= len(self.calls):
            raise ValueError(f"the draft reads a session's {len(self.calls)} calls in order: call {turn + 1} asked "
                             f"after {len(self.kept)}")
        call = self.calls[turn]
        if len(content_ids) != call.content:
            raise ValueError(f"call {turn + 1}'s new content is {len(content_ids)} tokens, its text's {call.content}: "
                             "the call's ids and its CallText disagree")
        return call

    def _read(self, ids: list[int], score: bool) -> torch.Tensor | None:
        """Run the draft over ``ids`` on top of its cache; where ``score``, its look-ahead queries' attention rows
        ``[queries, layers, heads, keys]`` over every key read so far, the look-ahead tokens then cut from the cache."""
        if not ids:
            raise ValueError("a call gives the draft no text to read (its question is never empty)")
        tokens = torch.tensor([ids], device=self.spec.draft.device)
        if len(ids) > 1:
            self._forward(tokens[:, :-1])
        if not score:
            self._forward(tokens[:, -1:])
            return None
        model, end = self.spec.draft, self.read + 1
        with attention_implementation(model, "eager"):  # attention probabilities are needed
            out = self._forward(tokens[:, -1:], attentions=True)
            rows = [_prompt_attention(out.attentions, end)]
            for _ in range(self.spec.look_ahead_cnt - 1):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                if int(token) in self.eos:  # the reference stops looking ahead at EOS
                    break
                out = self._forward(token, attentions=True)
                rows.append(_prompt_attention(out.attentions, end))
        self._cut_to(end)
        return torch.stack(rows)

    def _forward(self, ids: torch.Tensor, attentions: bool = False):
        model = self.spec.draft
        positions = torch.arange(self.read, self.read + ids.shape[1], device=ids.device)[None]
        out = model(input_ids=ids, position_ids=positions, use_cache=True, output_attentions=attentions,
                    logits_to_keep=1, **cache_kwargs(model, self.cache))
        self.cache, self.read = returned_cache(out), self.read + ids.shape[1]
        return out

    def _cut_to(self, end: int) -> None:
        """The look-ahead tokens dropped from the draft's cache: it holds the ``end`` tokens read again."""
        extra = self.read - end
        if extra:
            try:
                self.cache.crop(-extra)  # a negative count removes that many tokens, in every transformers 5
            except (RuntimeError, ValueError) as error:
                raise ValueError(f"the draft's cache cannot drop its {extra} look-ahead tokens ({error}); use "
                                 "look_ahead_cnt=1") from None
        self.read = end
        if self.cache.get_seq_length() != end:
            raise ValueError(f"the draft's cache holds {self.cache.get_seq_length()} tokens after its look-ahead, not "
                             f"the {end} it read; use look_ahead_cnt=1")

