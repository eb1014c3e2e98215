"""Continuous batching over static-size caches (:class:`Engine`), one role per module: the requests
(:mod:`.request`), the scheduler (:mod:`.scheduler`: queue, admission order, stop strings), the slot pool
(:mod:`.slot_pool`: allocation, admission), the per-slot cache and its attention (:mod:`.slot_cache`), the compiled
decode step (:mod:`.model_runner`), sampling (:mod:`.sampling`) and accounting (:mod:`.accounting`)."""

from .engine import Engine
from .model_runner import compile_backend
from .request import Completion, Request

__all__ = ["Completion", "Engine", "Request", "compile_backend"]
