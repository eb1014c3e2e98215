"""What lm-eval hands the ``evalkit`` model, read as evalkit's: ``--model_args`` and a generation request's options."""

from __future__ import annotations

import dataclasses

from evalkit.console import warn


@dataclasses.dataclass
class GenerationOptions:
    """A generation request's options (lm-eval's ``gen_kwargs``): stop strings, length, sampling and truncation."""

    until: list[str]
    max_new_tokens: int
    do_sample: bool
    temperature: float | None
    top_p: float | None
    truncation: str  # of a prompt longer than the context: "left" or "middle"
    max_len: int | None  # LongBench's cut of the raw prompt, in tokens

    @classmethod
    def from_lm_eval(cls, gen_kwargs: dict) -> GenerationOptions:
        """Greedy when ``do_sample`` is off or the temperature is 0 (temperature and top_p then unused)."""
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new_tokens = int(gen_kwargs.get("max_gen_toks", gen_kwargs.get("max_new_tokens", 256)))
        do_sample, temperature, top_p = bool(gen_kwargs.get("do_sample", False)), gen_kwargs.get("temperature"), \
            gen_kwargs.get("top_p")
        if temperature == 0:
            do_sample, temperature = False, None
        if not do_sample:
            temperature = top_p = None
        max_len = gen_kwargs.get("max_len")
        return cls(until, max_new_tokens, do_sample, temperature, top_p, gen_kwargs.get("truncation", "left"),
                   int(max_len) if max_len else None)


def model_arguments(arg_string: str, additional_config: dict | None, cuda_available: bool) -> dict:
    """``lm_eval --model evalkit --model_args ...`` as the model's keyword arguments: model_args win over lm-eval's
    own options. lm-eval fills ``device`` with ``cuda:0`` when none is given; without CUDA that default becomes
    ``auto`` (said once). lm-eval's ``batch_size=auto`` is dropped (evalkit has no batch size search)."""
    from lm_eval.utils import simple_parse_args_string

    args = simple_parse_args_string(arg_string)
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k in ("batch_size", "device")}
    if str(extra.get("device", "")).startswith("cuda") and "device" not in args and not cuda_available:
        warn(f"lm-eval's device {extra['device']} is not available here; running on the CPU "
             "(pass --device cpu to silence this)")
        extra["device"] = "auto"
    if str(extra.get("batch_size", "")).startswith("auto"):
        extra.pop("batch_size")
    return {**extra, **args}
