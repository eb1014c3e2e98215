"""A method config (``conf/method/<name>.yaml``'s keys) to its policy: the method's settings checked against their
declarations without torch (:mod:`evalkit.config.method_schema`), then the policy built. The one way the evalkit CLI,
``lm_eval --model evalkit`` and Python callers build a policy, so that all three refuse a bad value alike."""

from __future__ import annotations

import dataclasses
import difflib
from typing import TYPE_CHECKING

from evalkit.config.method_schema import config_settings, schemas
from evalkit.core.errors import ConfigError, InvalidCombination

if TYPE_CHECKING:  # torch loads with the first policy built, not with this module
    import evalkit.compression as ec


def check_known(section: dict, known, where: str = "") -> None:
    """Every key of ``section`` is one of ``known``; else one line naming the key and its nearest known spelling
    (``where``: the section's prefix, e.g. ``model.``)."""
    for key in section:
        if key not in known:
            near = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
            hint = f"did you mean {where}{near[0]}?" if near else f"known: {', '.join(sorted(map(str, known)))}"
            raise ConfigError(f"unknown setting {where}{key}: {hint}")


def method_settings(method_cfg: dict, budget: str | None, method_explicit: bool = True,
                    decoding_for: str | None = None) -> tuple[str, dict]:
    """The method a config's ``method`` section names and its settings, checked against the methods' declarations
    (names, types, bounds: :mod:`evalkit.config.method_schema`) without importing them: ``(method, settings)``. With
    ``method_explicit`` False, a method without a budget is the full-cache baseline (``evalkit task=X``). Rules
    between settings and the budget's size wait for the method itself. ``decoding_for``: the method whose decoding
    policy this is (spec_prefill's ``then``), named as such in the messages. Raises ConfigError (one line)."""
    method_cfg = dict(method_cfg)
    method = method_cfg.pop("name", None)
    known = schemas()
    if method == "spec_prefill":  # the draft's own settings are checked with it; here those of its decoding method
        method, method_explicit, decoding_for = method_cfg.get("then") or "full", True, "spec_prefill"
        method_cfg = {key: value for key, value in method_cfg.items()
                      if method in known and key in config_settings(known[method])}
    if method not in known:
        raise ConfigError(f"unknown method {method!r}; choose one of {sorted([*known, 'spec_prefill'])}")
    check_known(method_cfg, config_settings(known[method]), "method.")
    params = {key: value for key, value in method_cfg.items() if value is not None}
    error = known[method].problem(method_cfg)
    if error:  # also where the run is the full-cache baseline: a bad value is refused, never ignored
        raise ConfigError(error)
    if budget is None and method != "full" and not method_explicit:
        return "full", {}  # `evalkit task=X` with no budget is the full-cache baseline
    # speculative prefill's decoding method is named as such: the user did not type it as the method
    via = f"method={decoding_for} decodes with method.then={method}, and " if decoding_for else ""
    if budget is None and known[method].takes_budget:
        raise InvalidCombination(f"{via}method={method} needs a budget: add +budget=4x (or 2x, 8x, 16x, tokens_N)")
    if budget is not None and method == "full":
        if decoding_for:  # spec_prefill's default decoding: a full cache
            raise InvalidCombination(f"method={decoding_for} decodes with method.then=full, which takes no budget; "
                                     "drop +budget, or set method.then=snapkv (or another compressing method) to "
                                     "compress the cache while decoding")
        raise InvalidCombination("method=full takes no budget; drop +budget or pick a compressing method")
    if budget is not None and not known[method].takes_budget:
        raise InvalidCombination(f"{via}method={method} sizes its cache by its own settings and takes no budget; "
                                 "drop +budget")
    return method, params


def policy_from_config(method_cfg: dict, budget: str | None, max_context: int,
                       method_explicit: bool = True) -> ec.Policy:
    """The KV policy of a method config (``conf/method/<name>.yaml``'s keys, ``name`` among them) at ``budget`` (the
    budget grammar's text; None: none) over ``max_context`` tokens: the one way the evalkit CLI, ``lm_eval --model
    evalkit`` and Python callers build a policy, so that all three refuse a bad value alike. With ``method_explicit``
    False, a method without a budget is the full-cache baseline (``evalkit task=X``). Raises ConfigError (one line)."""
    import evalkit.compression as ec

    method_cfg, decoding_for = dict(method_cfg), None
    if method_cfg.get("name") == "spec_prefill":  # what the draft's settings leave configures the decoding policy
        method_cfg["name"], method_explicit = spec_prefill_settings(method_cfg)["then"], True
        decoding_for = "spec_prefill"
    method, params = method_settings(method_cfg, budget, method_explicit, decoding_for)
    try:
        return ec.policy_from_budget(method, budget, max_context, **params)
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None


def spec_prefill_settings(method_cfg: dict) -> dict:
    """Pop speculative prefill's own settings from ``method_cfg`` (what remains configures the decoding policy):
    SpecPrefill's fields with their defaults; the draft is named by draft_model, the decoding policy by `then`."""
    import evalkit.compression as ec

    fields = {f.name: f.default for f in dataclasses.fields(ec.SpecPrefill) if f.name not in ("draft", "draft_tokenizer")}
    settings = {key: method_cfg.pop(key, default) for key, default in fields.items()}
    try:
        ec.SpecPrefill(draft=None, draft_tokenizer=None, **settings)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"method.{error}") from None
    draft_model, then = method_cfg.pop("draft_model", None), method_cfg.pop("then", None) or "full"
    if not draft_model:
        raise ConfigError("method=spec_prefill needs method.draft_model=<hub id, local path or builtin:NAME>")
    return {**settings, "draft_model": draft_model, "then": then}

