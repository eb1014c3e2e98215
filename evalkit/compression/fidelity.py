"""Fidelity of a compressed cache to the full one, without labels: it gives a signal on any model and any prompt.

For the same prompts: the compressed run's greedy tokens against the full-cache run's (agreement, first divergence),
and the KL divergence KL(full || compressed) of the next-token distributions along the full run's own tokens
(teacher forcing: the compressed cache is fed the full run's tokens, so every position is compared on equal inputs).
"""

from __future__ import annotations

import torch

from .generate import generate
from .methods.base import Policy
from .methods.full import Full
from .session import CompressionSession


@torch.no_grad()
def fidelity(model, input_ids, policy: Policy, attention_mask=None, max_new_tokens: int = 32, eos_token_id=None) -> list[dict]:
    """Per row: ``token_agreement`` (share of the full run's greedy tokens the compressed run reproduces at the same
    positions), ``first_divergence`` (tokens before the first difference), ``kl_mean``/``kl_max`` over the full run's
    tokens, and ``compared_tokens``."""
    common = {"attention_mask": attention_mask, "max_new_tokens": max_new_tokens, "eos_token_id": eos_token_id}
    full = generate(model, input_ids, Full(), **common)
    compressed = generate(model, input_ids, policy, **common, return_logits=False)
    prompt = input_ids.shape[1]
    full_tokens = full.sequences[:, prompt:]
    generated = torch.tensor([s["generated_tokens"] for s in full.stats])
    # Teacher forcing: the full run's tokens through the compressed cache.
    session = CompressionSession(model, policy)
    first = session.prefill(input_ids, attention_mask)
    rest = session.step(full_tokens[:, :-1]) if full_tokens.shape[1] > 1 else first[:, None][:, :0]
    forced = torch.cat([first[:, None], rest], dim=1).log_softmax(-1)
    reference = full.logits.log_softmax(-1)
    kl = (reference.exp() * (reference - forced)).sum(-1).clamp(min=0)  # [B, new]
    rows = []
    for row in range(input_ids.shape[0]):
        count = int(generated[row])
        ours = compressed.sequences[row, prompt : prompt + count]
        same = ours == full_tokens[row, : len(ours)]
        same = torch.cat([same, torch.zeros(count - len(ours), dtype=torch.bool)])
        mismatch = (~same).nonzero()
        rows.append({
            "token_agreement": float(same.float().mean()) if count else 1.0,
            "first_divergence": int(mismatch[0]) if len(mismatch) else count,
            "kl_mean": float(kl[row, :count].mean()) if count else 0.0,
            "kl_max": float(kl[row, :count].max()) if count else 0.0,
            "compared_tokens": count,
        })
    return rows
