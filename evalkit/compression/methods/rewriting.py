"""The base of the wrappers that keep a scorer's ranking and rewrite what it keeps: key re-rotation, merging,
key-channel pruning (kvpress wraps a ``ScorerPress`` for each)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .wrapper import Wrapper


@dataclasses.dataclass
class Rewriting(Wrapper):
    """Keep ``capacity`` prompt tokens per KV head by the scorer's ranking (SnapKV's by default), then rewrite them
    (:meth:`~.base.Policy.rewrite`)."""

    rewrites: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.supports_latent = False
        self.latent_refusal = "it rewrites per-head keys or values; a latent cache holds neither"

    def refusal(self, scorer) -> str | None:
        cls = scorer if isinstance(scorer, type) else type(scorer)
        if cls.allocates or issubclass(cls, Wrapper):
            return "it takes a scorer's ranking, as kvpress' presses take a ScorerPress"
        return super().refusal(scorer)

    def prompt_capacity(self) -> int:
        return self.capacity
