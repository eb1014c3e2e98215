"""CaM, cache merging while decoding (Zhang et al., ICML 2024, https://openreview.net/forum?id=LCTmppB165; reference
code: kvpress 0.5.5 ``CAMPress``, ``kvpress/presses/cam_press.py`` over ``DecodingPress`` in ``decoding_press.py``;
KVCache-Factory lists it as CAM)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import check, setting

from ..kernels import reduce_groups
from ..views import DecodeView, PrefillView, held_as_prompt
from .base import Policy, refused_kv_format
from .wrapper import Wrapper


def merge_generator(seed: int, layer: int, position: int) -> torch.Generator:
    """The CPU generator a compression of layer ``layer`` at the decode step of text ``position`` draws its merge
    mask from: seeded with ``position + P * (layer + P * seed)`` (``P = 1_000_003``) mod 2**32 (the CPU generator
    reads 32 bits of its seed), so that a row draws alike alone, in a batch or in the engine."""
    return torch.Generator().manual_seed((position + 1_000_003 * (layer + 1_000_003 * seed)) % 2 ** 32)


@dataclasses.dataclass
class CaM(Wrapper):
    """A cache of ``capacity`` tokens brought back to ``target = capacity - interval`` every ``interval`` decode
    steps, the evicted tokens' values merged into the kept tokens that follow them.

    Prefill: the prompt keeps its ``target`` best tokens by ``scorer`` (KNorm unless a config names another;
    kvpress' ``CAMPress`` takes a scorer and names none), the same tokens for every KV head of a layer: the scorer's
    scores are averaged over the layer's KV heads, as CaM ranks while decoding (kvpress
    ``PrefillDecodingPress(scorer, CAMPress(scorer))``; a prompt of at most ``target`` tokens is kept whole, kvpress'
    ``CAMPress`` alone). Decoding: every held token carries ``A``, the attention the decode steps' queries gave it
    (summed over the steps from the first generated token, averaged over each KV group's query heads). kvpress counts
    the steps since the last compression and compresses once they reach ``interval`` while the cache holds more than
    ``target`` tokens; here, where the first generated token's position is the prompt's length ``n``, that is the
    step ``t0 = max(interval, target - min(n, target) + 1)`` and every ``interval`` steps after it (and, as a
    safeguard that this schedule never reaches, whenever the cache is full). A compression ranks the held tokens as
    a prompt (text order, the scorer's forced tokens kept, its last queries), keeps the ``target`` best and evicts
    the others. Each evicted token ``i`` (in text order) merges into its window, the ``merge_budget`` kept tokens
    after it (fewer at the end, none after the last kept token): per KV head, with probability
    ``clamp(A_i / mean(A over the window), 0, 1)`` (0 where it is NaN, 1 where infinite), ``v_i / |window|`` is added
    to the value of every token of the window, all merges computed from the values before any is added. The draws
    come from a generator of CaM's own (:func:`merge_generator`, from ``seed``, the layer and the step's position).
    ``buffer``: the most recent queries a scorer may read (kvpress' ``hidden_states_buffer_size``).

    Differences from kvpress: it draws the mask from torch's global generator; it merges the evicted tokens with the
    best scores, as many as steps were taken since the last compression, which is every evicted token whenever the
    cache was brought to ``target`` before (always here: the prompt is compressed at prefill); and under
    ``PrefillDecodingPress`` its prefill keeps each head's own tokens, which its compressions then average slot by
    slot although the heads' slots hold different tokens (here every head keeps the same), and keeps them in score
    order (``ScorerPress`` gathers in ``topk`` order): ``CAMPress`` takes an evicted token's window, and its merge
    order, by cache index, so after such a prefill its merges go to score neighbours; here to text neighbours, as
    CaM's official code (zyxxmu/cam ``local_cam_mask``) and ``CAMPress``' own docstring have it (on SmolLM2, 45 of 90
    heads hold kvpress' positions after 40 steps; with its prefill's order undone 90 of 90, values within 1.1e-5:
    ``benchmarks/parity_cam_prefill.py``). kvpress also compresses on
    a step of ``target`` tokens or more; here a step is one token. The merge is computed in fp32 (kvpress: in the
    attention's dtype) and the attention sums are fp32. ``kv_bits`` < 16 is refused: a merge rewrites held values,
    which the quantized format holds as codes.
    """

    name: ClassVar[str] = "cam"
    per_head: ClassVar[bool] = True
    evicts_while_decoding: ClassVar[bool] = True
    accumulates: ClassVar[bool] = True
    inline: ClassVar[tuple[str, dict]] = ("knorm", {})
    interval: int = setting(512, low=1)
    merge_budget: int = setting(32, low=1)
    buffer: int = setting(256, low=1)
    seed: int = setting(0, low=0)

    def __post_init__(self) -> None:
        check(self)  # its own settings first: the scorer is sized by them
        if self.capacity <= self.interval:
            raise ValueError(f"CaM.capacity must be > interval ({self.interval}), got {self.capacity} (lower interval "
                             "or raise the budget)")
        super().__post_init__()
        scorer, needed = self.scorer, self.scorer.prefill_queries()
        forced = scorer.kept_sink() + scorer.kept_window()
        reason = (f"it reads {needed} queries, more than the {min(self.buffer, self.interval)} kept (buffer, "
                  "interval)" if needed > min(self.buffer, self.interval)
                  else f"it forces {forced} tokens, not fewer than the {self.capacity - self.interval} kept "
                       "(capacity - interval)" if forced >= self.capacity - self.interval
                  else None)
        if reason:
            raise ValueError(f"CaM.scorer cannot be {scorer.name}: {reason}")
        self.supports_latent = False
        self.latent_refusal = "its merge has not been tested on a latent (MLA) cache"

    def refusal(self, scorer) -> str | None:
        cls = scorer if isinstance(scorer, type) else type(scorer)
        return ("it allocates budgets itself; CaM keeps one set of tokens per layer" if cls.allocates
                else "its score sums the attention of every query" if cls.sums_attention
                else "it scores from hidden states, which decoding does not keep" if cls.reads_hidden_states
                else "it reads every query of the sequence" if cls.reads_every_query
                or (isinstance(scorer, Policy) and scorer.prefill_queries() is None)
                else super().refusal(scorer))

    kv_format = refused_kv_format("its merges rewrite held values, which the quantized format holds as codes")

    def scorer_capacity(self) -> int:
        return self.capacity - self.interval

    def prompt_capacity(self) -> int:
        return self.capacity - self.interval

    def cache_capacity(self) -> int:
        return self.capacity

    def query_window(self) -> int:
        return max(1, self.scorer.prefill_queries())

    def score(self, view: PrefillView) -> torch.Tensor:
        """The scorer's scores averaged over the layer's KV heads, the same for each (``[B, Hkv, n]``)."""
        scores = self.scorer.score(view).float()
        return scores.mean(dim=1, keepdim=True).expand_as(scores)

    def select(self, view: PrefillView, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scorer's selection; the attention sums start at zero with the first decode step."""
        indices, counts, raw = super().select(view, kv_heads)
        return indices, counts, torch.zeros_like(raw)

    def due(self, view: DecodeView) -> torch.Tensor:
        """``[B]``: the rows whose step compresses (see the class)."""
        target, held = self.capacity - self.interval, view.valid[:, 0].sum(dim=-1)
        prompt = (view.position - view.steps + 1).clamp(max=target)
        first = (target - prompt + 1).clamp(min=self.interval)
        scheduled = (view.steps >= first) & ((view.steps - first) % self.interval == 0)
        return (held > target) & (scheduled | (held >= self.capacity))

    def decode_evict(self, view: DecodeView) -> torch.Tensor | None:
        batch, kv_heads, slots = view.valid.shape
        view.scores.add_(reduce_groups(view.probabilities.reshape(batch, kv_heads, -1, slots), "mean"))
        due = self.due(view)
        if not bool(due.any()):
            return None
        module = view.module
        config = getattr(module, "config", None)
        prompt, order = held_as_prompt(view.valid, view.keys, view.values, view.positions, query=view.query_buffer,
                                       scaling=view.scaling, layer_idx=getattr(module, "layer_idx", 0),
                                       num_layers=getattr(config, "num_hidden_layers", 1), module=module,
                                       rotary=view.rotary)
        indices, counts, _ = self.select(prompt, kv_heads)
        n = order.shape[-1]
        freed = torch.zeros_like(view.valid)
        for row in due.nonzero().flatten().tolist():  # every head holds the same tokens: head 0's order
            held = torch.arange(n, device=order.device) >= n - int(view.valid[row, 0].sum())
            kept = indices[row, 0, : int(counts[row, 0])]
            held[kept] = False
            evicted = held.nonzero().flatten()
            generator = merge_generator(self.seed, getattr(module, "layer_idx", 0), int(view.position[row]))
            self.merge(view.values[row], view.scores[row], order[row, 0], kept, evicted, generator)
            freed[row, :, order[row, 0, evicted]] = True
        return freed

    def merge(self, values: torch.Tensor, attention: torch.Tensor, order: torch.Tensor, kept: torch.Tensor,
              evicted: torch.Tensor, generator: torch.Generator) -> None:
        """Merge the ``evicted`` tokens' values into their windows of ``kept`` tokens, in place: ``values``
        ``[Hkv, S, D]`` and the attention sums ``attention`` ``[Hkv, S]`` of one row; ``kept`` and ``evicted`` count
        the held tokens in text order (ascending), ``order`` maps that count to the slots."""
        heads, dim = values.shape[0], values.shape[-1]
        start = torch.searchsorted(kept, evicted, right=True)
        window = start[:, None] + torch.arange(self.merge_budget, device=kept.device)  # [M, m]
        inside = window < kept.numel()
        targets = order[kept[window.clamp(max=kept.numel() - 1)]]  # slots
        evicted = order[evicted]
        size = inside.sum(dim=-1)  # [M]
        mean = (attention[:, targets] * inside).sum(dim=-1) / size.clamp(min=1)  # [Hkv, M]
        probability = (attention[:, evicted] / mean).nan_to_num(nan=0.0, posinf=1.0, neginf=1.0).clamp(0, 1)
        drawn = torch.bernoulli(probability.float().cpu(), generator=generator).to(values.device)
        scale = torch.where(size == 0, 0.0, drawn / size)  # [Hkv, M]
        work = values.float()
        contributions = (work[:, evicted] * scale[..., None])[:, :, None, :] * inside[None, :, :, None]
        index = targets.reshape(1, -1, 1).expand(heads, -1, dim)
        work.scatter_add_(1, index, contributions.reshape(heads, -1, dim))
        if work is not values:
            values.copy_(work)
