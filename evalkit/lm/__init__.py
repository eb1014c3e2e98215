"""The lm-eval adapter: the model ``evalkit`` (:class:`EvalkitLM`), how it reads lm-eval's requests and prompts, the
plugin that gives lm-eval's own command line ``--model evalkit``, and data-parallel replicas on Ray.

``EvalkitLM`` (torch, transformers) loads when first asked for, so that the plugin stays light."""


def __getattr__(name: str):
    if name == "EvalkitLM":
        from evalkit.lm.model import EvalkitLM

        return EvalkitLM
    raise AttributeError(f"module 'evalkit.lm' has no attribute {name!r}")
