"""What lm-eval hands the ``evalkit`` model, read as evalkit's: ``--model_args`` (checked before the model loads), a
generation request's options, the engine request built from it and the text and statistics lm-eval gets back."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import TYPE_CHECKING

from evalkit.core.console import warn
from evalkit.core.errors import ConfigError

if TYPE_CHECKING:  # torch loads with the model, not with this module
    import evalkit.compression as ec


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


PYTHON_ONLY = ("model", "tokenizer", "policy", "progress")  # the model's arguments that only Python callers pass


def check_model_arguments(arguments: dict, model_init) -> None:
    """``--model_args`` (as :func:`model_arguments` reads them) checked before the model loads, as the model would
    check them after: each key is an argument of ``model_init`` (the model's ``__init__``) or a setting of the method,
    the method's settings hold their declarations and the budget reads (:func:`evalkit.config.method_config.method_settings`,
    :func:`evalkit.core.budget.parse`). Raises ConfigError (one line)."""
    from evalkit.config.method_config import method_settings
    from evalkit.config.method_schema import config_settings, schemas
    from evalkit.core import budget as budget_grammar

    own = [name for name, parameter in inspect.signature(model_init).parameters.items()
           if name != "self" and parameter.kind is not parameter.VAR_KEYWORD]
    method, budget = arguments.get("method", "full"), arguments.get("budget")
    settings = {key: value for key, value in arguments.items() if key not in own}
    known = schemas()
    if method in known:  # spec_prefill: its own settings and its decoding method's, sorted out by method_settings
        declared, named = sorted(config_settings(known[method])), sorted(set(own) - set(PYTHON_ONLY))
        for key in [key for key in settings if key not in declared]:
            near = difflib.get_close_matches(str(key), named + declared, n=1, cutoff=0.6)
            if near and near[0] in declared:  # a misspelled setting of the method: said below as the CLI says it
                continue
            hint = f"did you mean {near[0]}?" if near else \
                f"the model's are {', '.join(named)}; method {method}'s are {', '.join(declared) or 'none'}"
            raise ConfigError(f"--model_args {key}: evalkit's model has no such setting; {hint}")
    method_settings({"name": method, **settings}, budget)
    try:
        budget_grammar.parse(budget)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def prepare_request(lm, text: str, gen_kwargs: dict, key: str, question: str | None = None) -> dict:
    """One lm-eval request as an engine request of ``lm`` (:class:`evalkit.lm.EvalkitLM`), plus what its text and
    statistics need afterwards (for :func:`finish_request`); ``question``: the text that follows the prompt's
    document."""
    import evalkit.compression as ec
    from evalkit.lm.prompts import context_end

    options, cut = GenerationOptions.from_lm_eval(gen_kwargs), False
    if options.truncation == "middle" and options.max_len:  # LongBench: on the raw prompt, before the template
        text, cut = lm.prompts.truncate_raw(text, options.max_len)
    positions, spec_stats, compress_prefix = None, {}, None
    if lm.spec_prefill is not None:
        # The draft reads the whole prompt; only the tokens it keeps reach the target, at their positions.
        input_ids, _, positions, (spec_stats,) = lm.spec_prefill.select(
            [text], lm.tokenizer, lm.tokenizer.pad_token_id,
            max_tokens=lm.max_context - options.max_new_tokens, add_special_tokens=[lm.prompts.add_special_tokens(text)])
        truncated, positions = spec_stats["truncated"], positions[0]
    else:
        input_ids, _, (truncated,), (start,) = lm.prompts.encode(
            [text], options.max_new_tokens, options.truncation, [context_end(text, question)])
        compress_prefix = start if lm.prompts.compression_scope == "context" else None
        lm.context_unmarked += lm.prompts.compression_scope == "context" and start is None
    stop_strings = [s for s in options.until if s and s not in lm.stop_token_texts]  # those end it as tokens
    # The sampling stream comes from the request itself: reproducible whatever ran before or beside it.
    request = ec.Request(input_ids[0].cpu(), max_new_tokens=options.max_new_tokens, do_sample=options.do_sample,
                         temperature=options.temperature, top_p=options.top_p, stop_strings=stop_strings,
                         seed=lm.seed + int(key[:8], 16), compress_prefix=compress_prefix, position_ids=positions)
    return {"request": request, "until": options.until, "truncated": truncated or cut, "spec": spec_stats}


def finish_request(lm, prepared: dict, completion: ec.Completion) -> tuple[str, dict]:
    """The text lm-eval gets (cut at the first stop string) and the statistics of a request :func:`prepare_request`
    made, once the engine has finished it."""
    import evalkit.compression as ec

    decoded = decoded_text(lm.tokenizer, completion.tokens, prepared["until"])
    stats = {**completion.stats, "truncated": prepared["truncated"],
             **cost_stats(lm, completion.stats, prepared["request"].compress_prefix)}
    stats.setdefault("prefill_tokens_computed", prepared["request"].input_ids.numel())  # a single request: its own
    stats.setdefault("prefill_tokens_shared", 0)  # prompt, run through the model whole, nothing shared
    if lm.fidelity_tokens:
        ids = prepared["request"].input_ids[None].to(lm.device)
        stats |= ec.fidelity(lm.model, ids, lm.policy, max_new_tokens=lm.fidelity_tokens,
                             eos_token_id=lm.stop_token_ids)[0]
    spec = prepared["spec"]
    if spec:
        stats |= {"prompt_tokens": spec["prompt_tokens"], "spec_kept_tokens": spec["kept_tokens"],
                  "draft_seconds": spec["draft_seconds"]}
    return decoded, stats


def decoded_text(tokenizer, tokens: list[int], until: list[str]) -> str:
    """Generated ``tokens`` as the text lm-eval gets: special tokens dropped, cut at the first of ``until``."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for stop in until:
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text


def cost_stats(lm, stats: dict, compress_prefix: int | None) -> dict:
    """What a finished request's statistics ``stats`` add up to against ``lm``'s policy: the memory model's price of
    its cache, whether it held more than the budget allows, and kvpress' compression_ratio, realized (the fraction
    of the compressed tokens removed). ``compress_prefix``: the tokens compression saw, where not the whole prompt."""
    compressed = compress_prefix or stats["prompt_tokens"]
    kept = stats["kept_prompt_tokens"]
    return {"compression_scope": lm.prompts.compression_scope,
            "kv_bytes_predicted": lm.cost.predicted_bytes(compress_prefix, stats),
            "over_budget": lm.cost.over_budget(stats, compressed),
            "compression_ratio": 1 - sum(kept) / len(kept) / compressed if kept else None}
