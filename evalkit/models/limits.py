"""A run's settings held to its model's own limits, read from the model's config alone (its weights need not load): the
positions it has (``max_context``), the cache its method needs (:meth:`~evalkit.compression.Policy.check_model`: a
latent or sliding-window cache, the head size a setting divides, files named after the model) and the layers its
per-layer settings count (:meth:`~evalkit.compression.Policy.check_layers`). A mistake is one ConfigError line.

The run checks before its data and its model load (:func:`checked_model_path`); the lm-eval model checks its loaded
model again, with the same function (:func:`check_model_limits`).
"""

from __future__ import annotations

from transformers import AutoConfig

from evalkit.core.errors import ConfigError, RunError, model_unavailable, one_line
from evalkit.models import resolve_pretrained


def checked_model_path(pretrained: str, policy, max_context: int, revision: str | None = None) -> str:
    """Where the model ``pretrained`` is (a hub id or local path as given; a built-in or GGUF model's folder), once its
    config allows ``policy`` and ``max_context``: a ConfigError saying what does not fit, a RunError where the model
    or its config cannot be read."""
    path, config = model_config(pretrained, revision)
    check_model_limits(config, policy, max_context, pretrained)
    return path


def model_config(pretrained: str, revision: str | None = None):
    """``(folder, config)`` of the model ``pretrained``, its weights unread; a RunError where it cannot be read."""
    try:
        path = resolve_pretrained(pretrained)
        return path, AutoConfig.from_pretrained(path, revision=revision)
    except (OSError, ValueError) as error:
        raise RunError(model_unavailable(pretrained, error)) from None


def check_model_limits(config, policy, max_context: int | None, model: str | None = None) -> None:
    """A ConfigError where ``policy`` or ``max_context`` does not fit the model of ``config`` (``model``: its name
    as the user gave it)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config  # a multimodal model's LM
    model = model or getattr(config, "name_or_path", None)
    limit = positions(config)
    if max_context is not None and limit is not None and max_context > limit[0]:
        raise ConfigError(f"model.max_context={max_context} is more than the {limit[0]} positions "
                          f"{f'model {model}' if model else 'the model'} has ({limit[1]} in its config): give "
                          f"model.max_context <= {limit[0]}")
    try:
        policy.check_model(config)
        policy.check_layers(config.num_hidden_layers)
        if policy.kv_format is not None:
            policy.kv_format.check_model(config)
    except ConfigError:  # a learned file's own line, which names the file
        raise
    except ValueError as error:
        raise ConfigError(one_line(error)) from None


def positions(config) -> tuple[int, str] | None:
    """The most positions the model's config allows and what says so: ``max_position_embeddings``, or a rope
    scaling's ``factor`` times the ``original_max_position_embeddings`` where that is more; None where the config
    says neither."""
    most = getattr(config, "max_position_embeddings", None)
    found = (most, "max_position_embeddings") if isinstance(most, int) and most > 0 else None
    for scaling in _rope_settings(config):
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and isinstance(original, int) and factor * original > (found or (0,))[0]:
            found = (int(factor * original), f"rope scaling: factor {factor} x original_max_position_embeddings "
                                             f"{original}")
    return found


def _rope_settings(config) -> list[dict]:
    """The config's rope scaling dicts (``rope_parameters`` or the older ``rope_scaling``; per layer kind where the
    model has several)."""
    found = []
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            found += nested or [value]
    return found
