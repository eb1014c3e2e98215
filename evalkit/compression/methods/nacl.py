"""NACL (Chen et al., ACL 2024, "NACL: A General and Effective KV Cache Eviction Framework for LLMs at Inference
Time"; reference code Zefan-Cai/KVCache-Factory ``pyramidkv/nacl.py``, ``select_nacl_tokens``, at commit
c97f9d706d63d1b56e980f8b81b2a924c21162b3)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..kernels import causal_visible, reduce_groups
from ..model_spec import attention_sinks
from ..views import PrefillView, scores_by_row
from .base import PromptScoring


def proxy_scores(view: PrefillView, window: int, gqa_reduce: str) -> torch.Tensor:
    """NACL's proxy-token score ``[B, Hkv, n]`` in float64: the softmax attention the prompt's last ``window``
    queries (the proxy tokens; causal among themselves) give each key, summed over them, then reduced over the query
    heads of each KV group."""
    n, held = view.keys.shape[2], view.query.shape[2]
    count = min(window, n, held)
    queries = view.query[:, :, held - count :].double()
    batch, q_heads, _, dim = queries.shape
    kv_heads = view.keys.shape[1]
    grouped = queries.reshape(batch, kv_heads, q_heads // kv_heads, count, dim)
    logits = grouped @ view.keys.double()[:, :, None].transpose(-1, -2) * view.scaling  # [B, Hkv, G, w, n]
    visible = causal_visible(view.key_valid, n - count, n)[:, :, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    sinks = attention_sinks(view.module)
    if sinks is None:
        probabilities = logits.softmax(dim=-1)
    else:  # learned sink logits (gpt-oss) take their share of the mass, as in the model's attention
        sink = sinks.double().reshape(1, kv_heads, -1, 1, 1).expand(batch, -1, -1, count, 1)
        probabilities = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return reduce_groups(probabilities.sum(dim=-2), gqa_reduce)


def ranked(scores: torch.Tensor) -> torch.Tensor:
    """Indices of ``scores`` ``[..., m]`` from the highest, ties to the earlier position."""
    return scores.sort(dim=-1, descending=True, stable=True).indices


@dataclasses.dataclass
class NACL(PromptScoring):
    """Proxy-token eviction plus random eviction, once, at the end of prefill.

    Per layer and KV head, of a prompt longer than ``capacity``: keep its first ``sink`` and last ``window`` tokens
    (the proxy tokens, protected); of the others, keep the ``capacity - sink - window - r`` of highest proxy score
    (:func:`proxy_scores`), then draw ``r = min(random_budget, capacity - sink - window)`` more at random without
    replacement from the rest, with probabilities ``softmax(score / random_temperature)`` over them (uniform at
    temperature 0). Generated tokens are appended (the cache grows, as SnapKV's). ``random_budget`` 0, the
    reference's default, is proxy-token eviction alone.

    Where the reference is silent or differs, each a choice of this implementation:

    * the reference's selector is given the attention; it is not wired into its model patches. The attention here is
      its SnapKV path's (softmax of the window queries over the prompt, causal among them) in float64, unpooled,
      with its kv-head granularity's group mean (``gqa_reduce``): evalkit caches per KV head, where the reference's
      default keeps a cache per query head;
    * its ``suffix`` proxy mode, the question placed last (the paper's proxy tokens are the question). ``edges`` is
      ``sink > 0`` (the first tokens' queries see only protected keys, so they add nothing to the others' scores);
      ``prefix``, whose queries see only protected keys, is not offered;
    * the random draw: the reference calls ``torch.multinomial`` (no replacement) with one caller-given generator
      shared by the batch's rows and heads. Here each prompt and layer draws uniforms ``u`` ``[kv_heads, n]`` in
      float64 from a CPU generator seeded ``seed * 2**16 + layer``, and takes the highest ``score / temperature -
      log(-log u)`` (the Gumbel form of the same distribution, which ``torch.multinomial`` also samples by): a prompt
      keeps the same tokens alone or in any batch, on every CPU;
    * ties in the top-k go to the earlier token (``torch.topk``'s order is unspecified); the reference's branch
      for ``sink + window >= capacity`` is refused at build time, as every prompt scorer's.

    The scores :meth:`score` returns are the proxy scores raised by ``2 * (window + 1)`` on the top-k picks and by
    ``window + 1`` on the random ones (a proxy score is at most ``window``): the ranking is tied to this method's
    own sizing, so no wrapper takes it.
    """

    name: ClassVar[str] = "nacl"
    wrappable: ClassVar[bool] = False
    window: int = setting(8, low=1)  # proxy tokens (the reference's LongBench window for its attention methods)
    random_budget: int = setting(0, low=0)
    random_temperature: float = setting(1.0, low=0)
    gqa_reduce: str = setting("mean", choices=("mean", "max"))
    seed: int = setting(0, low=0, high=4294967295)

    def prefill_queries(self) -> int:
        return self.window

    def score(self, view: PrefillView) -> torch.Tensor:
        return scores_by_row(view, self._one)

    def _one(self, alone: PrefillView) -> torch.Tensor:
        """The scores of one unpadded prompt ``[1, Hkv, m]``, its picks lifted above the rest."""
        proxy = proxy_scores(alone, self.window, self.gqa_reduce)[0]
        if proxy.shape[-1] <= self.capacity:  # kept whole
            return proxy[None]
        top, drawn = self._picks(proxy, alone.layer_idx)
        lift = float(self.window + 1)
        lifted = proxy.scatter_add(-1, top, torch.full_like(top, 2 * lift, dtype=proxy.dtype))
        return lifted.scatter_add(-1, drawn, torch.full_like(drawn, lift, dtype=proxy.dtype))[None]

    def _picks(self, proxy: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per KV head, the positions kept by score and those drawn at random, of a prompt longer than
        ``capacity`` (``proxy`` ``[Hkv, m]``): neither holds a protected token."""
        kv_heads, m = proxy.shape
        free = self.capacity - self.sink - self.window  # > 0, and m - sink - window > free
        drawn_count = min(self.random_budget, free)
        candidates = proxy[:, self.sink : m - self.window]
        top = ranked(candidates)[:, : free - drawn_count]
        generator = torch.Generator().manual_seed((self.seed << 16) + layer_idx)
        uniform = torch.rand(kv_heads, m, dtype=torch.float64, generator=generator)
        race = -torch.log(-torch.log(uniform[:, self.sink : m - self.window].to(proxy.device)))
        if self.random_temperature > 0:
            race = race + candidates / self.random_temperature
        drawn = ranked(race.scatter(-1, top, float("-inf")))[:, :drawn_count]
        return top + self.sink, drawn + self.sink
