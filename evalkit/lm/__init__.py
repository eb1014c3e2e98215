"""The lm-eval adapter: the model ``evalkit`` (:class:`EvalkitLM`), how it reads lm-eval's requests and prompts, the
plugin that gives lm-eval's own command line ``--model evalkit``, and data-parallel replicas on Ray.

``EvalkitLM`` (torch, transformers) loads when first asked for, so that the plugin stays light."""

# Names the earlier single module ``evalkit.lm`` held (its own imports), where they live now: they still import from
# here, with a DeprecationWarning naming that place.
MOVED_NAMES = {"load_model": "evalkit.models", "load_spec_prefill": "evalkit.models"}


def __getattr__(name: str):
    if name == "EvalkitLM":
        from evalkit.lm.model import EvalkitLM

        return EvalkitLM
    if name in MOVED_NAMES:
        import warnings

        import evalkit.models

        warnings.warn(f"evalkit.lm.{name} is now {MOVED_NAMES[name]}.{name}: import it from there", DeprecationWarning,
                      stacklevel=2)
        return getattr(evalkit.models, name)
    raise AttributeError(f"module 'evalkit.lm' has no attribute {name!r}")
