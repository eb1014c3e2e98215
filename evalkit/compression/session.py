"""Prefill, compress and decode with a policy: the loop under :func:`evalkit.compression.generate`."""

from __future__ import annotations

import copy
import weakref

import torch

from . import prefill_store
from .attention import hooked, recording_inputs, replay
from .cache import CompressedCache, PrefillPlan, RowState
from .layout import DecodeStep, additive_mask, layout_of
from .methods.base import Policy
from .methods.sliding_window import layer_policies
from .model_spec import cache_kwargs, check_hookable, rotary_embedding
from .packed_kv import packs
from .reconstruction import compress_by_passes

CHUNK_MODES = ("exact", "compress")


def chunk_mode_refusal(policy: Policy, chunk_mode: str) -> str | None:
    """Why ``policy`` cannot be prefilled in chunks under ``chunk_mode`` (None: it can)."""
    if chunk_mode not in CHUNK_MODES:
        return f"prefill_chunk_mode must be one of {list(CHUNK_MODES)}, got {chunk_mode!r}"
    if chunk_mode == "compress" and policy.rewrites:
        return (f"prefill_chunk_mode=compress would rewrite the tokens {policy.name} already rewrote at every chunk "
                "(use prefill_chunk_mode=exact)")
    if chunk_mode == "compress" and policy.extra_passes:
        return (f"prefill_chunk_mode=compress would drop tokens before {policy.name}'s passes over the whole prompt "
                "(use prefill_chunk_mode=exact)")
    if chunk_mode == "compress" and policy.reads_hidden_states:
        return (f"prefill_chunk_mode=compress cannot score the tokens it held with {policy.name}: their hidden states "
                "are gone (use prefill_chunk_mode=exact)")
    if chunk_mode == "compress" and (policy.per_head or type(policy).layer_budget is not Policy.layer_budget):
        return (f"prefill_chunk_mode=compress needs one budget for every layer and head; {policy.name} allocates "
                "per layer or head (use prefill_chunk_mode=exact)")
    return None


def _check_ids(caller: str, input_ids, batch: int | None = None, masks: dict | None = None) -> None:
    """Token ids ``[batch, tokens]`` of an integer dtype, ``batch`` rows where the session has them already; each of
    ``masks`` (a name: a tensor or None) of their shape."""
    rows = "batch" if batch is None else f"batch = {batch}"
    expected = f"{caller} takes input_ids of shape [{rows}, tokens] (integer ids)"
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"{expected}, got a {type(input_ids).__name__}")
    shape = list(input_ids.shape)
    if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.is_complex() or 0 in shape or \
            batch is not None and shape[0] != batch:
        hint = (": the next ids from step's logits [batch, q, vocab] are logits[:, -1].argmax(-1, keepdim=True)"
                if caller == "step" and input_ids.dim() == 3 else "")
        raise ValueError(f"{expected}, got shape {shape} ({input_ids.dtype}){hint}")
    for name, given in (masks or {}).items():
        if given is not None and list(given.shape) != shape:
            raise ValueError(f"{caller} takes {name} of input_ids' shape {shape}, got {list(given.shape)}")


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    # Same convention as transformers' generate: positions count real tokens; padding gets a harmless 1.
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


class CompressionSession:
    """One batch going through a model under a policy.

    ``prefill`` runs the prompt ``[batch, n]`` and compresses the cache; it returns the next token's logits
    ``[batch, vocab]``. ``step`` feeds new tokens ``[batch, q]`` (one per row, or a chunk that does not wrap a ring)
    and returns the logits of every token fed, ``[batch, q, vocab]``: the next token's are ``step(...)[:, -1]``, the
    shape ``prefill`` returns, so a greedy loop is ``logits = session.step(logits.argmax(-1, keepdim=True))[:, -1]``.
    Ids of any other shape are refused in one line. ``cache`` exposes the real tensors: ``cache.layers[i].keys`` is
    ``[batch, kv_heads, slots, head_dim]``.
    """

    fed_ids: list | None = None  # row 0's ids fed so far with their text positions, where a rule asked for them

    def __init__(self, model, policy: Policy):
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an evalkit.compression policy, got {type(policy).__name__}")
        check_hookable(model)
        if getattr(model.config, "kv_lora_rank", None) and not policy.supports_latent:
            raise ValueError(f"{policy.name} cannot score a latent (MLA) cache: {policy.latent_refusal}")
        policy.check_layers(model.config.num_hidden_layers)
        policy.bind_model(model)
        self.model = model
        self._build(policy)
        if policy.extra_passes and any(p is not policy for p in self.cache.layer_policies):
            raise ValueError(f"{policy.name} runs passes over every layer's whole prompt; this model's sliding-window "
                             "layers keep only their window")
        self.eager = model.config._attn_implementation == "eager"

    def _build(self, policy: Policy) -> None:
        self.policy = policy
        self.cache = CompressedCache(policy, self.model.config.num_hidden_layers, rotary_embedding(self.model),
                                     layer_policies(self.model, policy))
        self.layout = layout_of(policy)  # the row's: per-head layouts only count its tokens
        self.evicting = any(p.evicts_while_decoding for p in self.cache.layer_policies)

    def _size_for_prompt(self, real_len: torch.Tensor) -> None:
        """Under a fraction of each prompt removed (kvpress' ``compression_ratio``), the method sized by this
        prompt's length: one length per batch."""
        lengths = set(real_len.tolist())
        if len(lengths) > 1:
            raise ValueError(f"removing {self.policy.removed} of each prompt sizes the method by the prompt's own "
                             "length; this batch's prompts differ in length: prefill them one at a time (the engine "
                             "does)")
        targets = self.cache.targets
        self._build(self.policy.for_prompt(lengths.pop()))
        self.cache.targets = targets

    @property
    def state(self) -> RowState:
        return self.cache.state

    def fork(self) -> CompressionSession:
        """An independent copy of this session: the same cache and state so far, its own from here on; the model
        (every module, parameter and buffer) is shared, not copied. One context prefilled and compressed once, then
        continued many ways (:mod:`evalkit.compression.shared_context`)."""
        shared = (self.model, *self.model.modules(), *self.model.parameters(), *self.model.buffers())
        return copy.deepcopy(self, {id(obj): obj for obj in shared})

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
        chunk: int | None = None, chunk_mode: str = "exact",
    ) -> torch.Tensor:
        """Run the prompt ``input_ids`` ``[B, n]``, compress every layer, return the next token's logits ``[B, vocab]``
        (fp32; ``step`` returns one such row per token it is fed, ``[B, q, vocab]``).

        ``position_ids`` (default: counting the real tokens) lets a prompt whose tokens were dropped before prefill
        (speculative prefill) keep its tokens' original positions; decoding then continues from the largest + 1.

        ``chunk``: run the prompt through the model ``chunk`` tokens at a time, so activations and the attention's
        working set are bounded by the chunk (prompts without padding). ``chunk_mode``:

        * ``exact``: the whole prompt's keys and values stay until its last chunk, then the layer is compressed once,
          with the scores the unchunked prefill computes (the policy's last queries are kept between chunks; the
          attention sums of H2O and ObservedAttention are summed chunk by chunk): the same kept tokens and outputs,
          up to floating-point summation order; only the activation peak drops.
        * ``compress``: after every chunk the cache is compressed back to the policy's capacity, the policy applied
          to what the cache holds (its kept tokens, then the chunk) with the chunk's queries: a different method
          (the streaming setting of prompts longer than memory), whose cache never holds more than capacity + chunk.
          Policies with per-layer or per-head budgets and hybrid models are refused.
        """
        _check_ids("prefill", input_ids, masks={"attention_mask": attention_mask, "position_ids": position_ids})
        if chunk is not None:
            self._check_chunking(input_ids, attention_mask, chunk, chunk_mode)
        if self.cache.state is not None:
            raise RuntimeError("prefill was already run in this session")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        key_valid = attention_mask.bool()
        real_len = key_valid.sum(dim=1)
        if bool((real_len == 0).any()):
            raise ValueError("every row of input_ids needs at least one unmasked token")
        if self.policy.removed is not None:
            self._size_for_prompt(real_len)
        n = input_ids.shape[1]
        capacity = self.policy.prompt_capacity()
        keep = min(n, capacity) if capacity is not None else n
        positions = _position_ids(attention_mask) if position_ids is None else position_ids
        bounds = [(0, n)] if chunk is None or chunk >= n else [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
        chunked = len(bounds) > 1
        # Row layouts compress only rows over their budget or padded; per-head ones always.
        # A short prompt is rewritten, and its state kept, all the same.
        rewrites = any(p.rewrites or p.keeps_slot_state for p in self.cache.layer_policies)
        plan = PrefillPlan(key_valid, positions,
                           compress=bool((real_len > keep).any()) or not bool(key_valid.all()) or rewrites,
                           chunk_mode=chunk_mode if chunked else None, reserve=n if chunked and chunk_mode == "exact" else None,
                           defer=self.policy.extra_passes)
        logits = self._run_prompt(input_ids, None if chunked else attention_mask, positions, bounds, plan, keep)
        appended = None
        if self.cache.deferred:
            self.cache.plan = plan
            appended = compress_by_passes(self, input_ids, key_valid, positions)
            self.cache.plan = None
        seq_len = real_len.cpu() if position_ids is None else (position_ids.max(dim=1).values + 1).cpu()
        # the method's own tokens after the prompt (RestoreKV's): decoding goes on after them
        self.appended = torch.zeros_like(seq_len) if appended is None else appended.cpu()
        seq_len = seq_len + self.appended
        self._finish_prefill(real_len, keep, seq_len)
        return logits

    def _run_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor,
                    bounds: list[tuple[int, int]], plan: PrefillPlan, keep: int) -> torch.Tensor:
        """Run the prompt's passes (``bounds``: one, or its chunks) with the hook compressing every layer; return the
        last token's logits."""
        device, n = input_ids.device, input_ids.shape[1]
        self.cache.plan = plan
        store = prefill_store.active()
        key = store.key(self.model, input_ids, attention_mask, positions) if store and len(bounds) == 1 else None
        recorded = store.get(key, self.model) if key else None
        if recorded is not None:  # this model already ran over this prompt: its layers' calls, into this cache
            self.cache.compressed_layers = set()
            replay(self.cache, recorded, self.eager)
            self._check_every_layer_compressed()
            self.cache.plan = None
            return recorded.logits.clone()
        self.cache.recording = [] if key else None
        reads_hidden = any(p.reads_hidden_states for p in self.cache.layer_policies) or key is not None
        with hooked(self.model), recording_inputs(self.model, self.cache.layer_inputs, reads_hidden):
            for begin, end in bounds:
                plan.final = end == n
                if plan.chunk_mode == "compress":  # the cache's kept tokens, then the chunk: a prompt of its own
                    held = self.cache.get_seq_length() if begin else 0
                    plan.compress = held + end - begin > keep
                    plan.key_valid = torch.ones(len(input_ids), held + end - begin, dtype=torch.bool, device=device)
                    plan.positions = torch.cat([torch.full((len(input_ids), held), -1, device=device),
                                                positions[:, begin:end]], dim=1)
                self.cache.compressed_layers = set()
                output = self.model(input_ids=input_ids[:, begin:end], attention_mask=attention_mask,
                                    position_ids=positions[:, begin:end], use_cache=True, logits_to_keep=1,
                                    evalkit_cache=self.cache, **cache_kwargs(self.model, self.cache))
                self._check_every_layer_compressed()
        self.cache.plan = None
        logits = output.logits[:, -1].float()
        if key is not None:
            store.put(key, prefill_store.RecordedPrefill(weakref.ref(self.model), self.cache.recording, logits.clone()))
            self.cache.recording = None
        return logits

    def _check_every_layer_compressed(self) -> None:
        missing = set(range(len(self.cache.layers))) - self.cache.compressed_layers
        if missing:
            raise RuntimeError(
                f"the compression hook never ran for layers {sorted(missing)}: this model's attention does "
                "not go through transformers' AttentionInterface, so it cannot be compressed"
            )

    def _finish_prefill(self, real_len: torch.Tensor, keep: int, seq_len: torch.Tensor) -> None:
        """The row bookkeeping after prefill: per row, the slots its kept prompt holds, and where decoding goes on."""
        for layer in self.cache.layers:
            layer.reserved = None  # an uncompressed layer keeps its view of it; a compressed one, its own copy
        self.cache.prefill_slots = [layer.keys.shape[-2] for layer in self.cache.layers]
        slots, kept, fixed, ring = self.layout.row_plan(self.cache, real_len, keep, self.cache.finish_head_prefill())
        device = real_len.device
        self.cache.state = RowState(
            valid=torch.arange(slots, device=device)[None, :] < kept.to(device)[:, None],
            slot_pos=torch.full((len(kept), slots), -1, dtype=torch.long, device=device),
            seq_len=seq_len,
            written=kept.clone(),
            fixed=fixed,
            ring=ring,
            kept_prompt=kept.clone(),
            peak=kept.clone(),
        )
        self._quantize_prompt()

    def _quantize_prompt(self) -> None:
        """Under a quantized KV format, every layer's kept prompt as the format holds it."""
        for layer in self.cache.layers:
            fmt = layer.layout.policy.kv_format
            if fmt is None:
                continue
            held = layer.heads.valid if layer.heads is not None else \
                self.cache.state.valid[:, None, : layer.keys.shape[-2]].to(layer.keys.device)
            if packs(layer, self.cache):
                layer.pack(fmt, held)
            else:
                layer.keys, layer.values = fmt.quantize_prompt(layer.keys, layer.values, held)

    def _check_chunking(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, chunk: int,
                        chunk_mode: str) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer of tokens, got {chunk!r}")
        refusal = chunk_mode_refusal(self.policy, chunk_mode)
        if refusal:
            raise ValueError(refusal)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("chunked prefill takes prompts without padding (one prompt, or prompts of one length)")
        if chunk_mode == "compress" and any(p is not self.policy for p in self.cache.layer_policies):
            raise ValueError("prefill_chunk_mode=compress cannot keep a hybrid model's sliding-window layers apart")

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``input_ids`` ``[B, q]`` after the cached tokens; return their logits ``[B, q, vocab]`` (fp32): the next
        token's are ``[:, -1]``, ``[B, vocab]`` as ``prefill`` returns them.

        ``active`` (``[B]`` bool) marks the rows whose tokens count in the statistics (finished rows still run).
        """
        if self.cache.state is None:
            raise RuntimeError("call prefill before step")
        _check_ids("step", input_ids, len(self.state.seq_len))
        if active is not None and tuple(active.shape) != (len(input_ids),):
            raise ValueError(f"step takes active of shape [batch] = [{len(input_ids)}], got {list(active.shape)}")
        count, device = input_ids.shape[1], input_ids.device
        if self.fed_ids is not None:  # kept for a rule that reads the held text again (recompress_passes.keeps_fed_ids)
            self.fed_ids.append((input_ids[0].cpu(), self.state.seq_len[:1].cpu() + torch.arange(count)))
        if active is None:
            active = torch.ones(input_ids.shape[0], dtype=torch.bool)
        if count > 1 and (self.evicting or self.layout.wraps(self.state, count)):
            return torch.cat([self.step(input_ids[:, i : i + 1], active) for i in range(count)], dim=1)
        positions = self.state.seq_len[:, None].to(device) + torch.arange(count, device=device)
        self.cache.decode_steps += 1
        slots, mask, all_visible = self.layout.advance(self.state, count, active.cpu())
        steps = torch.full((len(input_ids),), self.cache.decode_steps, dtype=torch.long, device=device)
        self.cache.step = DecodeStep(positions, steps, active.to(device), slots, all_visible, self.state.slot_pos)
        if mask is not None and self.eager:
            mask = additive_mask(mask, self.model.dtype)
        with hooked(self.model):
            output = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                use_cache=True, evalkit_cache=self.cache, **cache_kwargs(self.model, self.cache))
        return output.logits.float()

    def realized(self, row: int) -> dict:
        """What row ``row`` held: ``kept_prompt_tokens`` (per layer, mean over KV heads),
        ``kept_prompt_tokens_per_head`` (per layer and head) and ``peak_cache_tokens`` (most tokens held at once,
        mean over layers and heads). Read off the cache's tensors and masks."""
        return self.cache.realized(row)
