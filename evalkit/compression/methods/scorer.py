"""Methods that decide how many tokens a layer or a head keeps and take the ranking from another method.

AdaKV (budgets shared among a layer's heads) and PyramidKV (budgets decreasing with depth) are allocation rules, not
scores: their papers pair them with SnapKV's score, and so do their presets here, but kvpress composes them over any
scorer (``AdaKVPress(KnormPress())``). ``scorer`` does the same: a score-based method by name (``"knorm"``), with its
settings (``{"name": "knorm", "window": 4}``), or as a policy (``KNorm(capacity=64)``). Only its score and the
tokens it forces (sink, window) are used; the wrapper decides the counts, and the cache then grows while decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import torch

from ..views import PrefillView
from .base import REGISTRY, Policy, SnapKVScoring, require_int, scorer_settings
from .snapkv import SnapKV


def build_scorer(scorer: str | Mapping | Policy, capacity: int, owner: str) -> Policy:
    """The scoring policy ``scorer`` names, sized by ``capacity``; a clear error for anything that cannot score."""
    if isinstance(scorer, Policy):
        policy = scorer
    else:
        if isinstance(scorer, str):
            name, settings = scorer, {}
        elif isinstance(scorer, Mapping):
            settings = dict(scorer)
            name = settings.pop("name", None)
        else:
            raise ValueError(f"{owner}.scorer must be a method name, its settings with a name, or a policy; "
                             f"got {scorer!r}")
        if name not in REGISTRY:
            raise ValueError(f"{owner}.scorer: unknown method {name!r}; choose one of {scorers()}")
        cls = REGISTRY[name]
        _refuse(cls, owner)  # before building it: its own setting errors would hide why it cannot score
        allowed = [field.name for field in dataclasses.fields(cls) if field.name not in cls.budget_fields]
        unknown = sorted(set(settings) - set(allowed))
        if unknown:
            raise ValueError(f"{owner}.scorer.{unknown[0]} is not a setting of {name} (its settings: {allowed})")
        try:
            policy = cls.from_budget(capacity, **settings) if cls.takes_budget else cls(**settings)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{owner}.scorer ({name}): {error}") from None
    _refuse(type(policy), owner)
    return policy


def _refuse(cls: type[Policy], owner: str) -> None:
    reason = _refusal(cls)
    if reason:
        raise ValueError(f"{owner}.scorer cannot be {cls.name}: {reason}; choose one of {scorers()}")


def _refusal(cls: type[Policy]) -> str | None:
    """Why a wrapper cannot take its ranking from method ``cls`` (None: it can)."""
    if issubclass(cls, OverScorer):
        return "it allocates budgets itself"
    if issubclass(cls, WithScorer):
        return "it takes a scorer itself"
    if not cls.needs_scores or cls.score is Policy.score:
        return "it does not score tokens"
    return None


def scorers() -> list[str]:
    """The registered methods a wrapper can take its ranking from."""
    return sorted(name for name, cls in REGISTRY.items() if _refusal(cls) is None)


@dataclasses.dataclass
class WithScorer:
    """The ``scorer`` field of a method built on SnapKV's score (its class comes before a SnapKVScoring base): None
    keeps SnapKV's score with the method's own fields; another score-based method ranks instead. With a scorer,
    SnapKV's fields must stay at the method's defaults (they would silently do nothing), except those the method
    itself uses (``scorer_free_fields``): the scorer's own settings go in ``scorer``."""

    scorer: str | dict | Policy | None = dataclasses.field(default=None, metadata={"recorded_when_set": True})
    scorer_free_fields: ClassVar[tuple[str, ...]] = ("capacity",)

    def _take_scorer(self) -> None:
        require_int(self, "capacity", 1)
        owner = type(self).__name__
        for field in dataclasses.fields(SnapKVScoring):
            default = next(f.default for f in dataclasses.fields(self) if f.name == field.name)
            if field.name not in self.scorer_free_fields and getattr(self, field.name) != default:
                raise ValueError(f"{owner}.{field.name} is a setting of the SnapKV score, unused with "
                                 f"scorer={_scorer_name(self.scorer)}: give the scorer's own settings in "
                                 f"{owner}.scorer (e.g. {{'name': 'knorm', 'window': 4}})")
        # One spelling recorded, whichever form was given; the scorer is rebuilt from it when used (an instance holds
        # only its fields, so that copies and ``dataclasses.replace`` stay plain).
        self.scorer = scorer_settings(build_scorer(self.scorer, self.capacity, owner))

    @property
    def scoring(self) -> Policy | None:
        """The scoring policy (None: SnapKV's score with this method's own fields)."""
        return None if self.scorer is None else build_scorer(self.scorer, self.capacity, type(self).__name__)

    # What the scorer decides: its score, the tokens it forces, the queries it reads, the latent support it claims.
    @property
    def sums_attention(self) -> bool:
        return super().sums_attention if self.scorer is None else self.scoring.sums_attention

    @property
    def supports_latent(self) -> bool:
        return super().supports_latent if self.scorer is None else self.scoring.supports_latent

    @property
    def latent_refusal(self) -> str:
        scoring = self.scoring
        return "" if scoring is None else f"its scorer {scoring.name}: {scoring.latent_refusal}"

    def unused_fields(self) -> tuple[str, ...]:
        if self.scorer is None:
            return ()
        return tuple(field.name for field in dataclasses.fields(SnapKVScoring)
                     if field.name not in self.scorer_free_fields)

    def kept_sink(self) -> int:
        return super().kept_sink() if self.scorer is None else self.scoring.kept_sink()

    def kept_window(self) -> int:
        return super().kept_window() if self.scorer is None else self.scoring.kept_window()

    def prefill_queries(self) -> int | None:
        return super().prefill_queries() if self.scorer is None else self.scoring.prefill_queries()

    def score(self, view: PrefillView) -> torch.Tensor:
        return super().score(view) if self.scorer is None else self.scoring.score(view)


@dataclasses.dataclass
class OverScorer(WithScorer, SnapKV):
    """Fields shared by the allocation wrappers (AdaKV, PyramidKV): SnapKV's own fields (the default scorer, as the
    reference methods have it) and ``scorer``."""

    def __post_init__(self) -> None:
        if self.scorer is None:
            super().__post_init__()
        else:
            self._take_scorer()


def _scorer_name(scorer) -> str:
    if isinstance(scorer, Policy):
        return scorer.name
    if isinstance(scorer, Mapping):
        return str(scorer.get("name"))
    return str(scorer)
