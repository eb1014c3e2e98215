"""Speculative prefill: a small draft model picks the prompt tokens the target model prefills.

Liu et al., "Speculative Prefill" (ICML 2025, arXiv 2502.02789; reference code Jingyu6/speculative_prefill,
``look_ahead_spec_worker.py``); cross-family drafts: arXiv 2603.02631. Defaults follow the reference code:

* ``look_ahead_cnt`` queries in all: the last prompt token, then up to ``look_ahead_cnt - 1`` tokens the draft
  decodes greedily (stopping at its EOS);
* each query's attention is a softmax over the PROMPT keys only (look-ahead tokens attend to the context, not to each
  other), per layer and head, in fp32;
* average pooling along the prompt with kernel ``pool_kernel`` (13), stride 1, padding counted (torch's default
  ``count_include_pad=True``); then max over layers x heads, mean over the queries;
* by chunks of ``chunk_size`` (32; the last one shorter), a chunk scoring the mean of its tokens, the top
  ``ceil(chunks x keep)`` WHOLE chunks are kept (without chunks: the top ``ceil(n x keep)`` tokens);
* nothing is forced.

Options beyond the reference (off by default): ``tail`` always keeps the prompt's last tokens (the question),
``keep_first`` the first token (the attention sink), ``pool_count_pad=False`` averages the edges over real tokens only.
The target prefills only the kept tokens, each at its ORIGINAL position, then decodes as usual (with any KV policy).

Draft and target may tokenize differently: importance then goes through characters. Each target token takes the
largest importance of the draft tokens whose character spans (fast tokenizers' offset mappings) overlap its own.
With the same tokenizer this is the identity.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from .attention import attention_implementation
from .model_spec import cache_kwargs, returned_cache
from .stopping import stop_token_ids


@dataclasses.dataclass
class SpecPrefill:
    draft: object  # a causal LM (any family; attention must be computable eagerly)
    draft_tokenizer: object  # its (fast) tokenizer
    keep: float = 0.1
    chunk_size: int | None = 32
    look_ahead_cnt: int = 8
    pool_kernel: int | None = 13
    pool_count_pad: bool = True
    tail: int = 0
    keep_first: bool = False

    def __post_init__(self):
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {self.chunk_size}")
        if self.look_ahead_cnt < 1:
            raise ValueError(f"look_ahead_cnt must be >= 1 (the last prompt token counts), got {self.look_ahead_cnt}")
        if self.tail < 0:
            raise ValueError(f"tail must be >= 0, got {self.tail}")
        if self.pool_kernel is not None and (self.pool_kernel < 1 or self.pool_kernel % 2 == 0):
            raise ValueError(f"pool_kernel must be a positive odd integer or None, got {self.pool_kernel}")

    # -- importance on the draft's own tokens ------------------------------------------------------------------------
    @torch.no_grad()
    def draft_importance(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Importance ``[n]`` of the draft tokens ``draft_ids`` ``[n]`` (one prompt)."""
        model = self.draft
        ids = draft_ids[None].to(model.device)
        n = ids.shape[1]
        eos = stop_token_ids(model, self.draft_tokenizer)
        with attention_implementation(model, "eager"):  # attention probabilities are needed
            out = model(input_ids=ids, use_cache=True, output_attentions=True)
            rows = [_prompt_attention(out.attentions, n)]
            cache, token = returned_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
            for step in range(self.look_ahead_cnt - 1):
                if int(token) in eos:  # the reference stops looking ahead at EOS
                    break
                out = model(input_ids=token, use_cache=True, output_attentions=True, **cache_kwargs(model, cache),
                            position_ids=torch.tensor([[n + step]], device=ids.device))
                rows.append(_prompt_attention(out.attentions, n))
                cache, token = returned_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)
        return self.pooled(torch.stack(rows))

    def pooled(self, rows: torch.Tensor) -> torch.Tensor:
        """Importance of every key from its queries' attention rows ``[queries, layers, heads, keys]``: average
        pooling along the keys (``pool_kernel``, padding counted as ``pool_count_pad`` says), max over layers x heads,
        mean over the queries."""
        if self.pool_kernel and self.pool_kernel > 1:
            flat = torch.nn.functional.avg_pool1d(rows.reshape(-1, 1, rows.shape[-1]), self.pool_kernel, stride=1,
                                                  padding=self.pool_kernel // 2, count_include_pad=self.pool_count_pad)
            rows = flat.reshape(rows.shape)
        return rows.amax(dim=(1, 2)).mean(dim=0).cpu()

    # -- mapping to the target's tokens and choosing -----------------------------------------------------------------
    def target_importance(self, text: str, target_tokenizer, add_special_tokens: bool = True
                          ) -> tuple[list[int], torch.Tensor]:
        """The target's token ids of ``text`` and the importance of each, mapped from the draft through characters.
        ``add_special_tokens=False`` for text that already holds them (a chat-templated prompt)."""
        target = target_tokenizer(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
        if _same_tokenizer(target_tokenizer, self.draft_tokenizer):
            return target["input_ids"], self.draft_importance(torch.tensor(target["input_ids"]))
        draft = self.draft_tokenizer(text, return_offsets_mapping=True)
        importance = self.draft_importance(torch.tensor(draft["input_ids"]))
        return target["input_ids"], map_by_characters(draft["offset_mapping"], importance, target["offset_mapping"])

    def choose(self, importance: torch.Tensor) -> torch.Tensor:
        """Sorted indices of the kept target tokens: the top ``ceil(chunks x keep)`` whole chunks (or
        ``ceil(n x keep)`` tokens), plus the forced ones when ``tail``/``keep_first`` ask for them. Equal scores keep
        the earlier chunk."""
        n = len(importance)
        size = self.chunk_size or 1
        chunks = torch.arange(n) // size
        count = int(chunks.max()) + 1
        chunk_score = torch.zeros(count).index_add_(0, chunks, importance.float()) / torch.bincount(chunks).float()
        forced = torch.zeros(count, dtype=torch.bool)
        if self.tail:
            forced[chunks[max(0, n - self.tail):]] = True
        if self.keep_first:
            forced[0] = True
        budget = max(int(forced.sum()), math.ceil(count * self.keep))
        order = chunk_score.masked_fill(forced, math.inf).sort(descending=True, stable=True).indices[:budget]
        kept = torch.zeros(count, dtype=torch.bool)
        kept[order] = True
        return torch.nonzero(kept[chunks]).flatten()

    def select(self, texts: list[str], target_tokenizer, pad_token_id: int, max_tokens: int | None = None,
               add_special_tokens: list[bool] | None = None):
        """Left-padded kept ids, attention mask and ORIGINAL position ids for the target, plus per-prompt stats.

        More than ``max_tokens`` kept tokens are cut from the left (the end of the prompt stays).
        """
        rows, stats = [], []
        special = add_special_tokens or [True] * len(texts)
        for text, add in zip(texts, special):
            start = time.perf_counter()
            ids, importance = self.target_importance(text, target_tokenizer, add)
            kept = self.choose(importance).tolist()
            truncated = max_tokens is not None and len(kept) > max_tokens
            kept = kept[-max_tokens:] if truncated else kept
            stats.append({"prompt_tokens": len(ids), "kept_tokens": len(kept), "truncated": truncated,
                          "draft_seconds": time.perf_counter() - start})
            rows.append(([ids[i] for i in kept], kept))
        width = max(len(r[0]) for r in rows)
        input_ids = torch.tensor([[pad_token_id] * (width - len(i)) + i for i, _ in rows])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i, _ in rows])
        positions = torch.tensor([[1] * (width - len(p)) + p for _, p in rows])
        return input_ids, mask, positions, stats


def _prompt_attention(attentions, n: int) -> torch.Tensor:
    """``[layers, heads, n]``: the last query's attention renormalized over the first ``n`` (prompt) keys, which is
    the softmax over those keys alone (the reference's look-ahead queries attend to the context only)."""
    rows = torch.stack([a[0, :, -1, :n] for a in attentions]).float()
    return rows / rows.sum(dim=-1, keepdim=True)


def _same_tokenizer(a, b) -> bool:
    return a is b or (type(a) is type(b) and a.get_vocab() == b.get_vocab())


def map_by_characters(draft_offsets, draft_importance: torch.Tensor, target_offsets) -> torch.Tensor:
    """Each target token's importance: the max over draft tokens whose character span overlaps its own.

    Tokens without characters (special tokens, offsets (0, 0)) get the max over all tokens, so that BOS-like tokens
    are never the ones dropped for lack of a match. Spans are in text order, so the overlapping draft tokens of a
    target token are a contiguous run, found by binary search.
    """
    spans = torch.tensor(draft_offsets, dtype=torch.long).reshape(-1, 2)
    real = spans[:, 1] > spans[:, 0]
    spans, importance = spans[real], draft_importance[real]
    targets = torch.tensor(target_offsets, dtype=torch.long).reshape(-1, 2)
    top = float(draft_importance.max()) if len(draft_importance) else 0.0
    out = torch.full((len(targets),), top)
    has_text = targets[:, 1] > targets[:, 0]
    if not len(spans):
        return out.masked_fill(has_text, 0.0)
    first = torch.searchsorted(spans[:, 1].contiguous(), targets[:, 0].contiguous(), right=True)  # ends after start
    last = torch.searchsorted(spans[:, 0].contiguous(), targets[:, 1].contiguous())  # starts before end
    width = int((last - first).clamp(min=0).max()) if len(targets) else 0
    best = torch.zeros(len(targets))
    for offset in range(width):  # over the few draft tokens one target token spans, not over tokens
        index = first + offset
        inside = index < last
        best = torch.where(inside, torch.maximum(best, importance[index.clamp(max=len(importance) - 1)]), best)
    return torch.where(has_text, best, out)
