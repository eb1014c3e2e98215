"""The decode step: one token for every slot at once, with static shapes (the slot each token takes, the attention
mask and the positions come from the slots' rows on the device), so that it compiles once (``torch.compile``; CUDA
graphs on GPU) and never recompiles."""

from __future__ import annotations

import torch

from ..attention import attention_implementation
from ..layout import additive_mask, ring_slot
from ..model_spec import cache_kwargs
from .sampling import choose_tokens
from .slot_cache import DECODE_ATTENTION
from .slot_pool import SlotPool


def compile_backend(value) -> str | None:
    """The ``compile`` setting as a torch.compile backend: off (false) is None, true is inductor; a backend name
    (``eager``, ``aot_eager``: graph capture without code generation) is itself."""
    if value in (None, False, "false", "False", "0", 0):
        return None
    if value in (True, "true", "True", "1", 1):
        return "inductor"
    backends = sorted({"inductor", *torch._dynamo.list_backends(exclude_tags=())})
    if not isinstance(value, str) or value not in backends:
        raise ValueError(f"compile must be true, false or a torch.compile backend in {backends}, got {value!r}")
    return value


class ModelRunner:
    """Runs ``steps`` decode steps over the pool's slots, compiled or not."""

    def __init__(self, model, pool: SlotPool, eos: torch.Tensor | None, *, compile: bool, backend=None,
                 mode: str | None = None):
        self.model, self.pool = model, pool
        self.eos_device = eos.to(model.device) if eos is not None else None
        # Row layouts keep an eager model's own attention (which takes an additive mask); per-head layouts need the
        # engine's masks.
        eager = model.config._attn_implementation == "eager"
        self.own_attention = (not eager or pool.head_layouts or pool.policy.selects_while_decoding
                              or pool.policy.kv_format is not None or pool.reduced is not None)
        self.compile, self.backend, self.mode = compile, backend, mode
        self._step_fn = None

    def run(self, steps: int, greedy_only: bool, use_top_p: bool) -> None:
        step = self._compiled_step()
        with attention_implementation(self.model, DECODE_ATTENTION if self.own_attention else None):
            for _ in range(steps):
                step(greedy_only, use_top_p)

    def _compiled_step(self):
        if self._step_fn is None:
            if not self.compile:
                self._step_fn = torch.no_grad()(self._step)
            else:
                mode = self.mode
                if mode is None and self.backend is None and self.model.device.type == "cuda":
                    mode = "reduce-overhead"  # CUDA graphs
                options = {"backend": self.backend} if self.backend is not None else {}
                self._step_fn = torch.no_grad()(torch.compile(self._step, dynamic=False, mode=mode, **options))
        return self._step_fn

    def _step(self, greedy_only: bool, use_top_p: bool) -> None:
        rows, cache = self.pool.rows, self.pool.cache
        active = ~rows.finished
        rows.active.copy_(active)
        slot = ring_slot(rows.written, rows.fixed, rows.ring)
        rows.write_slot.copy_(slot[:, None])
        rows.valid.scatter_(1, slot[:, None], True)  # finished rows too: they must keep attending somewhere
        rows.slot_pos.scatter_(1, slot[:, None], rows.positions)
        cache.sync()
        mask = rows.valid[:, None, None, :]
        if not self.own_attention:
            mask = additive_mask(mask, self.model.dtype)
        logits = self.model(input_ids=rows.next_token[:, None], attention_mask=mask, position_ids=rows.positions,
                            use_cache=True, evalkit_cache=cache, **cache_kwargs(self.model, cache)).logits
        logits = logits[:, -1].float().to(rows.finished.device)  # a device-mapped model's last layer may be elsewhere
        chosen = choose_tokens(logits, greedy_only, rows.seeds, rows.generated, rows.do_sample, rows.temperature,
                               rows.top_p, use_top_p)
        step = active.long()
        rows.written.add_(step)
        rows.positions.add_(step[:, None])
        # A finished row writes past its last token, over a column collected long ago: nothing it produced is lost.
        rows.out.scatter_(1, (rows.generated % rows.out.shape[1])[:, None], chosen[:, None])
        rows.generated.add_(step)
        rows.steps.add_(step)
        done = rows.generated >= rows.max_new
        if self.eos_device is not None:
            done |= torch.isin(chosen, self.eos_device)
        rows.finished.copy_(rows.finished | (active & done))
        rows.next_token.copy_(chosen)
