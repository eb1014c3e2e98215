"""Methods over other methods: AdaKV and PyramidKV allocate the budget a scorer's ranking fills, DecodingSnapKV
re-applies a method while decoding. A wrapper holds the method it wraps by value (``scorer``, built once), carries
none of its fields, and takes its capabilities as plain values on the instance; wrappers nest to any depth, as
kvpress' ``DecodingPress(AdaKVPress(KnormPress()))`` is ``DecodingSnapKV(AdaKV(KNorm))`` here.

A config names the wrapped method with its settings (``method.scorer=knorm``, ``{name: knorm, window: 4}``,
``{name: adakv, scorer: knorm}``); with none, the wrapper's ``inline`` method (SnapKV, the reference methods'
pairing) is built from the settings the config gives the wrapper itself (``method.window=16``), and the tables
record those flat, as a method of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..views import PrefillView
from .base import REGISTRY, Policy, named_settings


def build_scorer(spec: str | Mapping | Policy, capacity: int, owner: str, inline: bool = False,
                 field: str = "scorer") -> Policy:
    """The method ``spec`` names (a name, its settings with a name, or a method), sized by ``capacity``, for
    ``owner.field``. ``inline``: the wrapper's own method (its errors name the wrapper's settings)."""
    if isinstance(spec, Policy):
        return dataclasses.replace(spec, **{name: capacity for name in spec.budget_fields if name == "capacity"})
    if isinstance(spec, str):
        name, settings = spec, {}
    elif isinstance(spec, Mapping):
        settings = dict(spec)
        name = settings.pop("name", None)
    else:
        raise ValueError(f"{owner}.{field} must be a method name, its settings with a name, or a method; got {spec!r}")
    if name not in REGISTRY:
        raise ValueError(f"{owner}.{field}: unknown method {name!r}; choose one of {scorers()}")
    cls = REGISTRY[name]
    allowed = cls.config_settings()
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(f"{owner}.{field}.{unknown[0]} is not a setting of {name} (its settings: {list(allowed)})")
    try:
        return cls.from_config(capacity if cls.takes_budget else None, **settings)
    except (TypeError, ValueError) as error:
        if inline:  # its settings are the wrapper's own in a config: named as the wrapper's
            raise ValueError(str(error).replace(f"{cls.__name__}.", f"{owner}.", 1)) from None
        raise ValueError(f"{owner}.{field} ({name}): {error}") from None


def scorers() -> list[str]:
    """The registered methods that score tokens themselves, whose ranking any wrapper can take (wrappers nest too,
    where the outer one allows: see :meth:`Wrapper.refusal`)."""
    return sorted(name for name, cls in REGISTRY.items()
                  if not issubclass(cls, Wrapper) and cls.needs_scores and cls.score is not Policy.score
                  and cls.wrappable)


@dataclasses.dataclass
class Wrapper(Policy):
    """A method over ``scorer`` (see the module): its score, the tokens it forces and the queries it reads are the
    scorer's. ``scorer`` may be given as a method or as a config gives it (name, settings): it is built once, sized
    by the wrapper (:meth:`scorer_capacity`); None builds the ``inline`` method with the wrapper's defaults."""

    capacity: int = setting(low=1)
    scorer: Policy | str | dict | None = None
    needs_scores: ClassVar[bool] = True
    # The method a config gets when it names no scorer, and the wrapper's defaults for its settings.
    inline: ClassVar[tuple[str, dict]] = ("snapkv", {"window": 64, "kernel_size": 5, "pooling": "avg"})
    # Own settings that are also the inline method's (DecodingSnapKV's window: its query buffer and SnapKV's window).
    shared_with_inline: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        owner, spec = type(self).__name__, self.scorer
        if spec is None:
            spec = {"name": self.inline[0], **self.inline[1], **{n: getattr(self, n) for n in self.shared_with_inline}}
        name = _name(spec)
        if not isinstance(spec, Policy) and name in REGISTRY:  # before building it: its own errors would hide this
            self._refuse(REGISTRY[name])
        self.scorer = build_scorer(spec, self.scorer_capacity(), owner, inline=name == self.inline[0])
        self._refuse(self.scorer)
        # What the scorer decides, as plain values on this instance.
        self.sums_attention = self.scorer.sums_attention
        self.reads_hidden_states = self.scorer.reads_hidden_states
        self.supports_latent = self.scorer.supports_latent
        self.latent_refusal = f"its scorer {self.scorer.name}: {self.scorer.latent_refusal}"

    def scorer_capacity(self) -> int:
        """The capacity the wrapped method is built with."""
        return self.capacity

    def _refuse(self, scorer: Policy | type[Policy]) -> None:
        reason = self.refusal(scorer)
        if reason:
            raise ValueError(f"{type(self).__name__}.scorer cannot be {scorer.name}: {reason}; choose one of "
                             f"{scorers()}")

    def refusal(self, scorer: Policy | type[Policy]) -> str | None:
        """Why this wrapper cannot take its ranking from ``scorer`` (a method or its class), or None."""
        cls = scorer if isinstance(scorer, type) else type(scorer)
        if cls.allocates and self.allocates:
            return "it allocates budgets itself"
        if cls.evicts_while_decoding and issubclass(cls, Wrapper):
            return "it takes a scorer itself"
        if not cls.wrappable:
            return "its ranking is tied to its own schedule and sizing"
        if cls.rewrites:
            return "it rewrites the cache it keeps, which only the outermost method may do"
        if not cls.needs_scores or cls.score is Policy.score:
            return "it does not score tokens"
        return None

    @classmethod
    def config_settings(cls) -> tuple[str, ...]:
        own = super().config_settings()
        return (*own, *(name for name in REGISTRY[cls.inline[0]].config_settings() if name not in own))

    @classmethod
    def from_config(cls, capacity: int, scorer=None, **params) -> Policy:
        """From a config: ``params`` are the wrapper's own settings and, without ``scorer``, the inline method's
        (which must stay at the wrapper's defaults when a scorer is named: they would silently do nothing)."""
        own_names = super().config_settings()
        own = {name: value for name, value in params.items() if name in own_names}
        rest = {name: value for name, value in params.items() if name not in own_names}
        inline_name, defaults = cls.inline
        if scorer is None:
            scorer = {"name": inline_name, **defaults, **rest, **{n: own[n] for n in cls.shared_with_inline if n in own}}
            return cls(capacity=capacity, scorer=scorer, **own)
        for name, value in rest.items():  # a named scorer, SnapKV too, takes its settings in its own section
            if value != defaults.get(name, _default(REGISTRY[inline_name], name)):
                raise ValueError(f"{cls.__name__}.{name} is a setting of the SnapKV score, unused with scorer="
                                 f"{_name(scorer)}: give the scorer's own settings in {cls.__name__}.scorer "
                                 "(e.g. {'name': 'knorm', 'window': 4})")
        return cls(capacity=capacity, scorer=scorer, **own)

    def settings(self) -> dict:
        own = {name: value for name, value in super().settings().items() if name != "scorer"}
        wrapped = named_settings(self.scorer)
        if wrapped.pop("name") == self.inline[0]:  # the inline method: its settings recorded flat, as before
            return {**wrapped, **own}
        return {**own, "scorer": named_settings(self.scorer)}

    def check_layers(self, num_layers: int) -> None:
        self.scorer.check_layers(num_layers)

    def check_model(self, config) -> None:
        super().check_model(config)
        self.scorer.check_model(config)

    def kept_sink(self) -> int:
        return self.scorer.kept_sink()

    def kept_window(self) -> int:
        return self.scorer.kept_window()

    def prefill_queries(self) -> int | None:
        return self.scorer.prefill_queries()

    def score(self, view: PrefillView) -> torch.Tensor:
        return self.scorer.score(view)

    # The budget is the wrapper's, split as an allocating scorer splits it (DecodingSnapKV over AdaKV).
    def layer_budget(self, layer_idx: int, num_layers: int, real_len: torch.Tensor) -> torch.Tensor:
        if self.scorer.allocates:
            return self.scorer.layer_budget(layer_idx, num_layers, real_len)
        return super().layer_budget(layer_idx, num_layers, real_len)

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        if self.scorer.allocates:
            return self.scorer.allocate(scores, budget, layer_idx)
        return super().allocate(scores, budget, layer_idx)

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        return self.scorer.prompt_slots(n, kv_heads) if self.scorer.allocates else super().prompt_slots(n, kv_heads)


def _default(cls: type[Policy], name: str):
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    return None if field is None else field.default


def _name(spec) -> str:
    if isinstance(spec, Policy):
        return spec.name
    if isinstance(spec, Mapping):
        return str(spec.get("name"))
    return str(spec)
