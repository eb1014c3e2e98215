"""What one finished request cost against what its policy promised: whether its cache held more than the policy's
capacities allow, and the simulator's price of its cache (to hold :mod:`evalkit.memory` to what the engine
measured)."""

from __future__ import annotations

import evalkit.compression as ec
from evalkit.compression.methods.sliding_window import layer_policies


class RequestCost:
    """The checks of a run's requests against ``policy`` on ``model``."""

    def __init__(self, model, policy: ec.Policy):
        self.model, self.policy = model, policy
        self._geometry = None  # evalkit.memory's view of the model (False: it cannot price this one)

    def over_budget(self, stats: dict, compressed: int | None = None, tolerance: float = 0.01) -> bool | None:
        """Whether the request's cache held more than the policy's capacities allow (by more than ``tolerance``):
        the kept prompt tokens (mean over the layers the policy compressed and their heads: PyramidKV's and AdaKV's
        uneven shares average to the budget) against the prompt capacity, the peak (mean over layers) against the
        cache capacity, a hybrid model's sliding-window layers held to their own window. None without a capacity."""
        # a fraction of each prompt removed: the size of this one (its ``compressed`` tokens; default the prompt)
        policy = self.policy if self.policy.removed is None else self.policy.for_prompt(compressed or stats["prompt_tokens"])
        prompt_cap, cache_cap = policy.prompt_capacity(), policy.cache_capacity()
        if prompt_cap is None and cache_cap is None:
            return None
        kept = stats.get("kept_prompt_tokens") or []
        compressed_layers = stats.get("compressed_layers")
        if compressed_layers is not None and kept:
            kept = [kept[i] for i in compressed_layers if i < len(kept)]
        mean_kept = sum(kept) / len(kept) if kept else 0.0
        return bool((prompt_cap is not None and mean_kept > prompt_cap * (1 + tolerance))
                    or (cache_cap is not None and float(stats["peak_cache_tokens"]) > self._peak_cap(policy, cache_cap)
                        * (1 + tolerance)))

    def _peak_cap(self, policy: ec.Policy, cache_cap: int) -> float:
        """The most tokens a cache may hold at once, mean over layers: ``cache_cap`` on the layers ``policy``
        compresses, its window on a hybrid model's sliding-window layer."""
        caps = [cache_cap if p is policy else p.cache_capacity() for p in layer_policies(self.model, policy)]
        return sum(caps) / len(caps)

    def predicted_bytes(self, compress_prefix: int | None, measured: dict) -> float | None:
        """``evalkit.memory``'s price of a request's cache (the model's geometry read from its config, the policy's
        declared capacities), its first ``compress_prefix`` tokens compressed (None: the whole prompt); None where it
        cannot price the model."""
        if self._geometry is None:
            from evalkit.memory.geometry import from_hf_config

            try:
                self._geometry = from_hf_config(self.model.config)
            except (ValueError, TypeError, AttributeError):
                self._geometry = False
        if not self._geometry:
            return None
        prompt = int(measured["prompt_tokens"])
        tail = prompt - compress_prefix if compress_prefix is not None else 0
        policy = self.policy.for_prompt(prompt - tail)  # a fraction of each prompt removed: this prompt's size
        return float(self._geometry.request_kv_bytes(
            prompt, int(measured["generated_tokens"]), str(self.model.dtype).removeprefix("torch."),
            policy.prompt_capacity(), policy.cache_capacity(), uncompressed_tail=tail, kv_format=policy.kv_format))
