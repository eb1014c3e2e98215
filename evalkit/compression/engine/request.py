"""What goes into the engine and comes out: a :class:`Request`, a :class:`Chat` of several turns, a :class:`Completion`,
and the host's record of the request a slot serves (:class:`Resident`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass
class Request:
    """One generation: prompt token ids and its own settings.

    ``compress_prefix`` and ``position_ids`` mean what they mean for :func:`evalkit.compression.generate`.
    ``prefix``: a :class:`~evalkit.compression.session.CompressionSession` prefilled (and compressed) before, which
    this request continues: ``input_ids`` are the tokens after it (a query over a shared context). Admission copies
    the session's cache into the slot and prefills only ``input_ids`` on top; the session itself is left as it was,
    for the next request over the same context.
    """

    input_ids: Sequence[int] | torch.Tensor
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    stop_strings: Sequence[str] = ()
    seed: int = 0
    compress_prefix: int | None = None
    position_ids: Sequence[int] | torch.Tensor | None = None
    prefix: object | None = None

    def __post_init__(self) -> None:
        self.input_ids = torch.as_tensor(self.input_ids, dtype=torch.long).reshape(-1)
        if self.input_ids.numel() == 0:
            raise ValueError("a request needs at least one prompt token")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if (self.temperature is not None or self.top_p is not None) and not self.do_sample:
            raise ValueError("temperature and top_p apply only with do_sample=True")
        if self.prefix is not None and (self.compress_prefix is not None or self.position_ids is not None):
            raise ValueError("a request over a prefilled prefix takes neither compress_prefix nor position_ids")
        self.stop_strings = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        if self.position_ids is not None:
            self.position_ids = torch.as_tensor(self.position_ids, dtype=torch.long).reshape(-1)
            if self.position_ids.shape != self.input_ids.shape:
                raise ValueError("position_ids must have one position per prompt token")


@dataclasses.dataclass
class Chat:
    """A conversation whose turns are asked in order (:meth:`Engine.run_chats`), as
    :func:`evalkit.compression.generate_shared` runs ``mode="multi_turn"``.

    ``turns[0]`` is the first turn's request as any other (a query over a prefilled context, ``prefix=``; or the
    context and the query, ``compress_prefix=``; or both compressed together). Each later turn is a request of the
    user's ids alone (no ``prefix``, ``compress_prefix`` or ``position_ids``: the engine sets where it goes on): it
    continues the conversation after the last answer's last token (``gold`` None: the model's own answer stays in
    the conversation) or after ``gold[t]`` in place of turn ``t``'s answer (the model answers on a copy). Where the
    last answer ended with an end-of-sequence id and the turn's ids begin with it, it is fed once.
    """

    turns: Sequence[Request]
    gold: Sequence[Sequence[int] | torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.turns = list(self.turns)
        if not self.turns or not all(isinstance(turn, Request) for turn in self.turns):
            raise ValueError("a chat needs at least one turn, each an evalkit.compression.engine.Request")
        if any(t.prefix is not None or t.compress_prefix is not None or t.position_ids is not None
               for t in self.turns[1:]):
            raise ValueError("a chat's later turns are the user's ids alone: the engine continues the conversation "
                             "(no prefix, compress_prefix or position_ids)")
        if self.gold is not None:
            self.gold = [torch.as_tensor(answer, dtype=torch.long).reshape(-1) for answer in self.gold]
            if len(self.gold) != len(self.turns):
                raise ValueError(f"a chat's gold history is one answer per turn: {len(self.turns)} turns, "
                                 f"{len(self.gold)} answers")


@dataclasses.dataclass
class Completion:
    index: int  # the request's place in the stream
    tokens: list[int]  # generated tokens (EOS included when it ended the request; nothing after a stop string)
    stats: dict  # as generate()'s stats, plus reserved_cache_tokens (the slot's allocation)


@dataclasses.dataclass
class Resident:
    """Host-side record of the request a slot serves."""

    index: int
    request: Request
    stats: dict
    written_at_start: int  # cache writes before the first decode step (to size a growing cache)
    held_at_start: int  # tokens the cache held after prefill
    limit: int  # most tokens the cache can hold (fixed + ring)
    ended_at_once: bool  # its first token ended it
    tokens: list[int] = dataclasses.field(default_factory=list)
    stop: object | None = None
    admitted_at: float = 0.0  # host clock when its first token was chosen (end of its admission)
    session: object | None = None  # a chat's turn: the session admission moved into the slot (kept for the next turn)
