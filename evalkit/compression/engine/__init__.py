"""Continuous batching over static-size caches (:class:`Engine`), one role per module: the requests and chats
(:mod:`.request`), the scheduler (:mod:`.scheduler`: queue, admission order, stop strings), the slot pool
(:mod:`.slot_pool`: allocation, admission), the per-slot cache and its attention (:mod:`.slot_cache`), the compiled
decode step (:mod:`.model_runner`), sampling (:mod:`.sampling`), accounting (:mod:`.accounting`), a chat's turns
(:mod:`.chats`) and a slot copied back into a session between them (:mod:`.slot_snapshot`)."""

from .engine import Engine
from .model_runner import compile_backend
from .request import Chat, Completion, Request

__all__ = ["Chat", "Completion", "Engine", "Request", "compile_backend"]
