"""Log-likelihood against a compressed cache (compress-then-score): the context is prefilled and compressed, then
the continuation is fed through the same decode path as generated tokens would be."""

from __future__ import annotations

import torch

from .methods.base import Policy
from .session import CompressionSession


@torch.no_grad()
def score_continuation(model, policy: Policy, ids: list[int], split: int) -> tuple[float, bool, dict]:
    """The log-probability of ``ids[split:]`` after ``ids[:split]`` compressed by ``policy``, whether greedy decoding
    would produce it, and the realized compression (with ``prompt_tokens``)."""
    ids = torch.tensor([ids], device=model.device)
    session = CompressionSession(model, policy)
    first = session.prefill(ids[:, :split])
    rest = session.step(ids[:, split:-1])[0] if ids.shape[1] - split > 1 else first[:0]
    logits = torch.cat([first, rest]).log_softmax(dim=-1)
    target = ids[0, split:]
    logprob = float(logits.gather(1, target[:, None]).sum())
    greedy = bool((logits.argmax(dim=-1) == target).all())
    return logprob, greedy, {"prompt_tokens": split, **session.realized(0)}
