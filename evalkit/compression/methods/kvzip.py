"""KVzip and KVzip+ (Kim et al., arXiv 2505.23416; snu-mllab/KVzip; kvpress ``KVzipPress``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from .adakv import pooled_counts
from .base import Policy

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk that a later chunk's prompt repeats


@dataclasses.dataclass(frozen=True)
class ReconstructionPrompts:
    """The token ids KVzip's passes are made of: the chat template's text before a user message (``prefix``: not
    reconstructed where the prompt starts with it) and after it (``suffix``), and the request to repeat the context
    (``first``) or a later chunk of it (``next``)."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    first: tuple[int, ...]
    next: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ReconstructionPrompts:
        """As kvpress derives them: the template split around a dummy user message ("\\n" after it without one)."""
        prefix, suffix = "", "\n"
        if getattr(tokenizer, "chat_template", None) is not None:
            dummy = "dummy context"
            separator = "\n" + "#" * len(dummy)
            text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                                 add_generation_prompt=True, tokenize=False, enable_thinking=False)
            context, suffix = text.split(separator)
            prefix = context.split(dummy)[0]

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(ids(prefix), ids(suffix), ids(FIRST_PROMPT), ids(NEXT_PROMPT))


def value_output_norms(module, values: torch.Tensor, groups: int) -> torch.Tensor:
    """``[1, Hkv, G, t]``: ``||v W_O||``, what each value ``values`` ``[1, Hkv, t, D]`` (fp32) writes into the
    residual stream through each query head of its group (``module.o_proj``)."""
    out = module.o_proj.weight.float().view(-1, values.shape[1], groups, values.shape[-1])  # [d_model, Hkv, G, D]
    # ||v W_O||^2 = v^T (W_O^T W_O) v: a D x D Gram matrix per query head instead of a d_model row per key
    gram = torch.einsum("jhgi,jhgk->hgik", out, out)
    return torch.einsum("bhti,hgik,bhtk->bhgt", values, gram, values).clamp(min=0).sqrt()


@dataclasses.dataclass
class KVzip(Policy):
    """Each prompt token is scored by how much the model attends to it when asked to repeat the prompt: after the
    prefill, the model runs "Repeat the previous context exactly." + the chat template's turn end + the prompt, a
    ``chunk_size`` chunk at a time (later chunks start from the previous chunk's last 8 tokens), over the prompt's
    cache. In every layer the pass's queries attend to the first ``sink`` tokens, the chunk and the pass itself
    (causally); a token's score is the most attention any query of its KV group gives it. The first ``sink`` tokens
    are always kept; a chat template's leading text (where the prompt starts with it) is not reconstructed and
    scores 0.

    The budget is the whole model's: ``num_layers * kv_heads * capacity`` tokens per prompt go to the best scores of
    every layer and head at once (``layerwise``: each layer keeps ``kv_heads * capacity`` across its heads). This is
    kvpress' ``KVzipPress``, except that the pruned tokens leave the cache instead of being masked. The passes cost
    about two more prefills and hold every layer's whole prompt until they end (the rows' ``kv_bytes_prefill_peak``).
    """

    name: ClassVar[str] = "kvzip"
    needs_scores: ClassVar[bool] = True
    per_head: ClassVar[bool] = True
    extra_passes: ClassVar[bool] = True
    budget_free_passes: ClassVar[bool] = True
    latent_refusal: ClassVar[str] = "its passes score per-head keys"
    # KVzip+: a query's attention divided by the norm of its hidden state, a key's multiplied by ||v W_O||.
    normalized: ClassVar[bool] = False
    capacity: int = setting(low=1)
    sink: int = setting(4, low=0)
    chunk_size: int = setting(2048, low=1)
    layerwise: bool = False
    # The reconstruction prompt's ids, not a setting: from the model's tokenizer (:meth:`bind_tokenizer`) or given
    # (:meth:`with_prompts`).
    prompts: ClassVar[ReconstructionPrompts | None] = None

    def bind_tokenizer(self, tokenizer) -> None:
        if self.prompts is None:
            self.prompts = ReconstructionPrompts.from_tokenizer(tokenizer)

    def with_prompts(self, prompts: ReconstructionPrompts) -> KVzip:
        """The method with its reconstruction prompt given as ids (a model without a tokenizer at hand)."""
        self.prompts = prompts
        return self

    def prompt_capacity(self) -> int:
        return self.capacity

    def prompt_slots(self, n: int, kv_heads: int) -> int:
        # One head may take its layer's whole budget (layerwise), or any share of the model's.
        return min(n, kv_heads * self.capacity) if self.layerwise else n

    def passes(self, ids: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """For one unpadded prompt ``ids`` ``[n]``: per pass, the span ``[start, end)`` of the prompt it scores and
        its input ids."""
        if self.prompts is None:
            raise ValueError(f"{self.name} needs the model's tokenizer for its reconstruction prompt: give generate "
                             "or the Engine tokenizer=, or call with_prompts)")
        prompts, tokens = self.prompts, ids.tolist()
        start = len(prompts.prefix) if tuple(tokens[: len(prompts.prefix)]) == prompts.prefix else 0
        out = []
        for begin in range(start, len(tokens), self.chunk_size):
            chunk = tokens[begin : begin + self.chunk_size]
            # a later chunk's prompt ends with the previous chunk's last OVERLAP tokens (all of it when shorter)
            ask = list(prompts.first) if begin == start else [*prompts.next, *tokens[begin - min(OVERLAP, self.chunk_size):begin]]
            out.append((begin, begin + len(chunk), torch.tensor([*ask, *prompts.suffix, *chunk])))
        return out

    def pass_scores(self, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    hidden: torch.Tensor | None, scaling: float, start: int, end: int) -> torch.Tensor:
        """``[1, Hkv, end - start]``: the most attention a pass's query gives each token of ``[start, end)``.
        ``query`` ``[1, Hq, q, D]`` (post-RoPE), ``keys``/``values`` ``[1, Hkv, n + q, D]`` (the prompt's, then the
        pass's), ``hidden`` ``[1, q, d_model]`` the attention's input."""
        return self.pass_weights(module, query, keys, values, hidden, scaling, start, end).amax(dim=(2, 3))

    def pass_weights(self, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     hidden: torch.Tensor | None, scaling: float, start: int, end: int) -> torch.Tensor:
        """``[1, Hkv, G, q, end - start]`` (fp32): each pass query's softmax weight on each token of ``[start, end)``,
        over the first ``sink`` tokens, the span and the pass's own keys up to the query (arguments as
        :meth:`pass_scores`)."""
        count, kv_heads = query.shape[2], keys.shape[1]
        groups = query.shape[1] // kv_heads
        sink = min(self.sink, start)
        picked = torch.cat([torch.arange(sink), torch.arange(start, end),
                            torch.arange(keys.shape[2] - count, keys.shape[2])]).to(keys.device)
        k, v = keys.index_select(2, picked).float(), values.index_select(2, picked).float()
        q = query.float().view(1, kv_heads, groups, count, -1)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scaling
        causal = torch.ones(count, count, dtype=torch.bool, device=keys.device).triu(1)
        logits[..., -count:] = logits[..., -count:].masked_fill(causal, float("-inf"))
        weights = logits.softmax(dim=-1)
        if self.normalized:
            weights = weights / hidden.float().norm(dim=-1)[:, None, None, :, None]
            weights = weights * value_output_norms(module, v, groups)[:, :, :, None, :]
        return weights[..., sink : sink + end - start]

    def kept_context(self, real_len: torch.Tensor) -> torch.Tensor:
        """The prompt tokens each row keeps per layer and KV head on average, of its length ``real_len`` ``[B]``."""
        return real_len.clamp(max=self.capacity)

    def allocate_layers(self, scores: torch.Tensor, real_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From every layer's scores ``[L, B, Hkv, n]`` (``-inf`` on padding) and each row's prompt length ``[B]``:
        the scores ranked (the sinks at ``+inf``) and the tokens each layer and KV head keeps ``[L, B, Hkv]``."""
        layers, batch, kv_heads, n = scores.shape
        first = (n - real_len)[None, :, None, None]
        position = torch.arange(n, device=scores.device)
        sinks = (position >= first) & (position < first + self.sink)
        scores = scores.masked_fill(sinks, float("inf"))
        budget = self.kept_context(real_len)
        if self.layerwise:
            return scores, torch.stack([pooled_counts(layer, budget) for layer in scores])
        flat = scores.permute(1, 0, 2, 3).reshape(batch, -1)  # a row's every layer and head
        rank = flat.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        chosen = (rank < (budget * layers * kv_heads)[:, None]) & (flat > float("-inf"))
        return scores, chosen.view(batch, layers, kv_heads, n).sum(dim=-1).permute(1, 0, 2)


@dataclasses.dataclass
class KVzipPlus(KVzip):
    """KVzip+ (kvpress ``kvzip_plus_normalization``): KVzip's attention over a pass, each query's divided by the norm
    of its hidden state and each key's multiplied by the norm of what its value writes into the residual stream,
    ``||v W_O||`` (per query head of the group)."""

    name: ClassVar[str] = "kvzip_plus"
    normalized: ClassVar[bool] = True
