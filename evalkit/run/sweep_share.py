"""What the jobs of one sweep share when they run in one process (Hydra's basic launcher): the loaded model, reused
by every job that loads the same one, and the prefills of its prompts (:mod:`evalkit.compression.prefill_store`),
replayed for every method after the first. A sweep of methods over the same prompts then runs the model over each
prompt once; what the rows record of the outputs, kept tokens and cache bytes is what separate runs record."""

from __future__ import annotations

import gc

from evalkit.compression.prefill_store import PrefillStore

DEFAULT_BYTES = 4 << 30  # at most this many bytes of recorded prefills, and a quarter of the free (GPU) memory


class SweepShare:
    def __init__(self, max_bytes: int | None = None):
        if max_bytes is None:
            import psutil

            max_bytes = min(DEFAULT_BYTES, psutil.virtual_memory().available // 4)
        self.store = PrefillStore(max_bytes)
        self.loaded: tuple | None = None  # (load arguments, model, tokenizer)
        self.loads = 0

    def model_for(self, spec):
        """The model and tokenizer ``spec`` loads: the one loaded already where its load arguments are the same."""
        from evalkit.models import load_model

        key = (spec.pretrained, spec.dtype, spec.device, spec.revision, repr(spec.device_map))
        if self.loaded is None or self.loaded[0] != key:
            self.loaded = None
            self.store.clear()  # recorded for the model that goes
            gc.collect()
            model, tokenizer = load_model(str(spec.pretrained), dtype=spec.dtype, device=spec.device,
                                          revision=spec.revision, device_map=spec.device_map)
            self.loaded, self.loads = (key, model, tokenizer), self.loads + 1
            if model.device.type == "cuda":  # the recorded prefills stay where the model made them
                import torch

                self.store.max_bytes = min(self.store.max_bytes, torch.cuda.mem_get_info(model.device)[0] // 4)
        return self.loaded[1], self.loaded[2]
