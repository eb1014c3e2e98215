"""``generate``: sampling or greedy decoding with a compressed cache, and what it realized."""

from __future__ import annotations

import dataclasses
import time

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from .methods.base import Policy
from .session import CompressionSession
from .stopping import eos_ids, stop_criteria, stop_token_ids


@dataclasses.dataclass
class GenerationOutput:
    sequences: torch.LongTensor  # [batch, prompt + new]
    logits: torch.FloatTensor | None  # [batch, new, vocab]: next-token logits at each generated step (before sampling)
    stats: list[dict]  # per sample, see `generate`
    session: CompressionSession | None = None  # the session, under ``keep_session=True`` (``kept_positions`` reads it)


def _validate(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_p, stop_strings, tokenizer):
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, length] with length >= 1, got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if attention_mask is not None and bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("padding must be on the left (the last column of attention_mask is 0 for some row)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if temperature is not None and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if (temperature is not None or top_p is not None) and not do_sample:
        raise ValueError("temperature and top_p apply only with do_sample=True")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer")


def prefill(model, policy: Policy, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            compress_prefix: int | None = None, position_ids: torch.Tensor | None = None,
            prefill_chunk: int | None = None, prefill_chunk_mode: str = "exact", targets: list | None = None):
    """Prefill and compress a batch of prompts (see :func:`generate` for ``compress_prefix``, ``position_ids`` and
    ``prefill_chunk``). ``targets``: the engine's slot for a one-prompt batch, per layer ``(keys, values)``; the
    compressed prompt goes straight into it (:meth:`~evalkit.compression.cache.CompressedCache.write_through`).

    Returns the session, the next-token logits ``[batch, vocab]`` and the seconds it took (time to first token).
    """
    if position_ids is not None and compress_prefix is not None:
        raise ValueError("compress_prefix and position_ids cannot be combined")
    session = CompressionSession(model, policy)
    session.cache.targets = targets
    started = time.perf_counter()
    if compress_prefix is None or compress_prefix >= input_ids.shape[1]:
        logits = session.prefill(input_ids, attention_mask, position_ids, prefill_chunk, prefill_chunk_mode)
    else:
        if not 1 <= compress_prefix or (attention_mask is not None and bool((attention_mask[:, compress_prefix - 1] == 0).any())):
            raise ValueError(f"compress_prefix={compress_prefix} must leave every row at least one real token to compress")
        head_mask = attention_mask[:, :compress_prefix] if attention_mask is not None else None
        session.prefill(input_ids[:, :compress_prefix], head_mask, None, prefill_chunk, prefill_chunk_mode)
        logits = session.step(input_ids[:, compress_prefix:])[:, -1]
    if logits.is_cuda:
        torch.cuda.synchronize(logits.device)
    return session, logits, time.perf_counter() - started


def _row_stats(session, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generated: torch.Tensor,
               prefill_seconds: float) -> list[dict]:
    """Per row: its prompt and generated tokens, what its cache realized, and the tokens it saw."""
    batch = input_ids.shape[0]
    prompt_tokens = (attention_mask.sum(dim=1).cpu() if attention_mask is not None else torch.full((batch,), input_ids.shape[1]))
    # Tokens written while a row was still generating: its prompt plus every generated token fed back.
    seen = prompt_tokens + (generated - 1).clamp(min=0)
    stats = []
    for row in range(batch):
        realized = session.realized(row)
        stats.append({
            "prompt_tokens": int(prompt_tokens[row]),
            "generated_tokens": int(generated[row]),
            **realized,
            "tokens_seen": int(seen[row]),
            "realized_ratio": float(seen[row]) / float(realized["peak_cache_tokens"]),
            "prefill_seconds": prefill_seconds,
        })
    return stats


def eos_and_pad(model, tokenizer, eos_token_id, pad_token_id: int | None) -> tuple[torch.Tensor | None, int]:
    """The ids a row stops on (``eos_token_id=None``: :func:`stop_token_ids`; ``[]``: none) and the id a finished row
    is filled with (default: the first of them, else 0)."""
    eos = eos_ids(stop_token_ids(model, tokenizer) if eos_token_id is None else eos_token_id)
    return eos, (int(eos[0]) if eos is not None else 0) if pad_token_id is None else pad_token_id


def _chooser(do_sample: bool, temperature: float | None, top_p: float | None, seed: int | None, device):
    """The next token from the logits: the argmax, or a draw after temperature and top-p (transformers' warpers)
    from a generator seeded with ``seed``."""
    if not do_sample:
        return lambda sequences, logits: logits.argmax(dim=-1)
    warpers = LogitsProcessorList()
    if temperature is not None:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else torch.seed())

    def choose(sequences: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        probabilities = warpers(sequences, logits).softmax(dim=-1)
        return torch.multinomial(probabilities, 1, generator=generator).squeeze(1)

    return choose


def generate(model, input_ids: torch.LongTensor, policy: Policy, attention_mask: torch.Tensor | None = None,
             max_new_tokens: int = 64, do_sample: bool = False, temperature: float | None = None,
             top_p: float | None = None, eos_token_id: int | list[int] | None = None,
             stop_strings: str | list[str] | None = None, tokenizer=None, seed: int | None = None,
             pad_token_id: int | None = None, return_logits: bool = True, compress_prefix: int | None = None,
             position_ids: torch.Tensor | None = None, prefill_chunk: int | None = None,
             prefill_chunk_mode: str = "exact", keep_session: bool = False) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens per row with the cache under ``policy``.

    Prompts in a batch are left-padded (``attention_mask`` 0 on padding). A row stops at an EOS id or once its text
    ends with a stop string; ``eos_token_id=None`` stops on :func:`stop_token_ids` (``[]``: on none); finished rows are filled with ``pad_token_id`` (default: the first EOS id, else 0).
    ``stats`` per row: ``prompt_tokens``, ``generated_tokens``, ``kept_prompt_tokens`` (per layer, after prefill;
    the mean over KV heads), ``kept_prompt_tokens_per_head`` (per layer and KV head), ``peak_cache_tokens`` (most
    tokens the cache held for the row; for per-layer or per-head budgets, the mean over layers and heads),
    ``tokens_seen`` (tokens written to the cache) and ``realized_ratio`` = tokens_seen / peak_cache_tokens (1.0 for
    a full cache).
    ``return_logits=False`` skips the ``[batch, new, vocab]`` logits, which long generations cannot afford.

    ``compress_prefix``: compress only the first ``compress_prefix`` columns of ``input_ids`` (the document); the rest
    of the prompt (the question) is then prefilled on top of the compressed cache like decoded tokens, with no
    eviction by SnapKV (a ring policy treats them as its first generated tokens). ``None``: compress the whole prompt
    (query-aware: the observation window ends with the question). Question-agnostic compression is what KV caches
    reused across questions get.

    ``position_ids``: the prompt tokens' positions when they are not 0..n-1 (the tokens speculative prefill kept, at
    their original positions); generated tokens continue from the largest + 1.

    ``prefill_chunk`` / ``prefill_chunk_mode``: prefill the prompt that many tokens at a time, ``exact`` (compressed
    once at the end: the same result, a lower activation peak) or ``compress`` (compressed back to capacity after
    every chunk: a different method); see :meth:`CompressionSession.prefill`.

    ``keep_session=True``: the output's ``session`` is the session as generation left it (its cache, for
    :func:`evalkit.compression.kept_positions`); with ``max_new_tokens=1`` no step runs, so it is as prefill left it.
    """
    _validate(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_p, stop_strings, tokenizer)
    if tokenizer is not None:
        policy.bind_tokenizer(tokenizer)
    eos, pad_token_id = eos_and_pad(model, tokenizer, eos_token_id, pad_token_id)
    choose = _chooser(do_sample, temperature, top_p, seed, input_ids.device)
    stop = stop_criteria(tokenizer, stop_strings, input_ids.shape[1]) if stop_strings else None
    session, logits, prefill_seconds = prefill(model, policy, input_ids, attention_mask, compress_prefix, position_ids,
                                               prefill_chunk, prefill_chunk_mode)
    sequences, generated, all_logits = decode(session, logits, input_ids, max_new_tokens, choose, eos, stop,
                                              pad_token_id, return_logits)
    stats = _row_stats(session, input_ids, attention_mask, generated, prefill_seconds)
    stacked = torch.stack(all_logits, dim=1) if return_logits else None
    return GenerationOutput(sequences=sequences, logits=stacked, stats=stats, session=session if keep_session else None)


def decode(session: CompressionSession, logits: torch.Tensor, sequences: torch.Tensor, max_new_tokens: int, choose,
           eos: torch.Tensor | None, stop, pad_token_id: int, return_logits: bool = False):
    """Up to ``max_new_tokens`` tokens per row after ``logits`` (the last prompt token's), each fed back into the
    session but the last; a row stops at an EOS id or a stop string. Returns the sequences with the new tokens, the
    count each row generated, and the logits of every step (empty unless ``return_logits``)."""
    unfinished, generated = torch.ones(len(sequences), dtype=torch.bool), torch.zeros(len(sequences), dtype=torch.long)
    all_logits = []
    for step in range(max_new_tokens):
        if return_logits:
            all_logits.append(logits)
        next_tokens = choose(sequences, logits)
        next_tokens = torch.where(unfinished.to(next_tokens.device), next_tokens, pad_token_id)
        generated += unfinished.long()
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
        if eos is not None:
            unfinished &= ~torch.isin(next_tokens.cpu(), eos)
        if stop is not None:
            unfinished &= ~stop(sequences, None).cpu()
        if not bool(unfinished.any()) or step == max_new_tokens - 1:
            break
        logits = session.step(next_tokens[:, None], active=unfinished)[:, -1]
    return sequences, generated, all_logits
