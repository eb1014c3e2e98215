"""KVgrad (https://openreview.net/forum?id=cg1wTCJjjk; kvpress ``KVgradPress``): KVzip's passes, each followed by a
backward pass."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

import torch

from evalkit.core.method_settings import setting

from ..model_spec import attention_modules
from .kvzip import KVzip, value_output_norms


@contextlib.contextmanager
def traced(model, captured: dict):
    """For the duration: autograd on (inference mode off), the model's parameters frozen (no gradient of theirs is computed), its input
    embeddings a leaf that requires grad (so that the pass is traced through the frozen weights), and ``captured``
    filled with each attention's output ``[1, q, d_model]`` by layer index and the last decoder layer's under
    ``"last"`` (before the final norm)."""

    def leaf(module, args, output):
        return output.detach().requires_grad_()

    def attention(module, args, output):
        captured[module.layer_idx] = output[0]

    def last(module, args, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    frozen = [parameter for parameter in model.parameters() if parameter.requires_grad]
    handles = [model.get_input_embeddings().register_forward_hook(leaf),
               model.get_decoder().layers[-1].register_forward_hook(last),
               *(module.register_forward_hook(attention) for module in attention_modules(model))]
    for parameter in frozen:
        parameter.requires_grad_(False)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)
        for handle in handles:
            handle.remove()


@dataclasses.dataclass
class KVgrad(KVzip):
    """Each prompt token is scored by its input-times-gradient effect on the last hidden states while the model
    repeats the prompt: KVzip's passes (the same prompts and chunks), and after each one a backward pass of
    ``Phi = sum over the pass's tokens p of ||h_p||^2``, ``h`` the last decoder layer's output (before the final
    norm). In layer ``l`` token ``c`` of the chunk scores ``max over p and the query heads of its group of
    A_{p,c} * ||v_c W_O|| * ||grad_{a_p} Phi||``: ``A`` the pass's attention as KVzip's (over the first ``sink``
    tokens, the chunk and the pass itself), ``||v_c W_O||`` the norm of what the token's value writes into the
    residual stream through that query head, and ``a_p`` the layer's attention output at pass token ``p`` (the
    residual stream it is added to has the same gradient). Budget, sinks and ``layerwise`` as KVzip's.

    Each pass is traced by autograd with the parameters frozen: until its backward pass ends it holds every layer's
    copy of the prompt with the pass (counted in ``kv_bytes_prefill_peak``) and the activations; the passes cost
    about three to four prefills. This is kvpress' ``KVgradPress``, except that the pruned tokens leave the cache
    instead of being masked.
    """

    name: ClassVar[str] = "kvgrad"
    chunk_size: int = setting(512, low=1)
    # Per layer of the pass running: the attention times ||v W_O|| [1, Hkv, q, chunk] (the most over the group)
    # and the bytes of the layer's keys and values that autograd holds; None outside a pass.
    pending: ClassVar[dict[int, tuple[torch.Tensor, int]] | None] = None

    def pass_scores(self, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    hidden: torch.Tensor | None, scaling: float, start: int, end: int) -> None:
        """Keeps the layer's part of the scores that needs no gradient (arguments as KVzip's); :meth:`run_pass`
        writes the scores once the backward pass is over."""
        with torch.no_grad():
            weights = self.pass_weights(module, query, keys, values, hidden, scaling, start, end)  # [1, Hkv, G, q, t]
            written = value_output_norms(module, values[:, :, start:end].float(), weights.shape[2])  # [1, Hkv, G, t]
            # the gradient's norm depends on p alone: the most over the group first leaves the same maximum
            weighted = (weights * written[:, :, :, None, :]).amax(dim=2)
        self.pending[module.layer_idx] = (weighted, sum(t.numel() * t.element_size() for t in (keys, values)))
        return None

    def run_pass(self, model, call, observer) -> None:
        """The pass ``call()`` traced, then ``Phi``'s gradient at every layer's attention output, and each layer's
        scores written to ``observer``."""
        captured: dict = {}
        self.pending = {}
        try:
            with traced(model, captured):
                call()
                layers = sorted(self.pending)
                objective = captured["last"].float().square().sum()
                gradients = torch.autograd.grad(objective, [captured[layer] for layer in layers])
            observer.session.cache.count_held_bytes(sum(held for _, held in self.pending.values()))
            for layer, gradient in zip(layers, gradients):
                sensitivity = gradient.float().norm(dim=-1)  # [1, q]: ||grad_{a_p} Phi|| per pass token
                observer.write(layer, (self.pending[layer][0] * sensitivity[:, None, :, None]).amax(dim=2))
        finally:
            self.pending = None
