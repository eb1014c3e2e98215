"""The lm-eval model ``evalkit``: a transformers causal LM whose KV cache is compressed by a policy.

    lm_eval --model evalkit --model_args pretrained=PATH,method=snapstream,budget=4x,max_context=8192 \
        --include_path tasks/ --tasks kv_retrieval

``generate_until`` hands all of a task's requests to :class:`evalkit.compression.Engine` (continuous batching over
``batch_size`` slots of one static cache size each). Log-likelihood requests are scored
against the compressed cache of the context (compress-then-score): the context is prefilled and compressed, then the
continuation is fed through the same decode path as generated tokens would be. Rolling log-likelihood (perplexity
over whole documents) has no compressed meaning here and is refused.
"""

from __future__ import annotations

from collections import Counter

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

import evalkit.compression as ec
from evalkit.measure import Throughput
from evalkit.method_config import policy_from_config
from evalkit.models import load_model
from evalkit.progress import request_keys
from evalkit.prompts import CONTEXT_END, SCOPES, TRUNCATIONS, truncate_middle


def stats_keys(requests) -> list[tuple]:
    """``(task, doc_id, repeat)`` of each request: the key its statistics are stored under, so that a sample's row
    gets its own request's numbers whatever order the requests finish in. lm-eval hands a prompt sampled n times as
    the same request n times, in the order it stores their responses; ``repeat`` counts a document's requests in that
    order (for log-likelihood, its choices). A request without lm-eval's metadata is its own document, named by its
    place in the call."""
    seen: Counter = Counter()
    keys = []
    for position, request in enumerate(requests):
        doc_id = getattr(request, "doc_id", None)
        owner = (getattr(request, "task_name", None), position if doc_id is None else doc_id)
        keys.append((*owner, seen[owner]))
        seen[owner] += 1
    return keys


@register_model("evalkit")
class EvalkitLM(LM):
    """A transformers model plus a compression policy, as an lm-eval ``LM``.

    Per-request statistics of the realized compression are kept in ``request_stats``, keyed by request
    (:func:`stats_keys`), for the result tables.
    """

    def __init__(
        self,
        pretrained=None,
        model=None,
        tokenizer=None,
        policy: ec.Policy | None = None,
        method: str = "full",
        budget: str | None = None,
        max_context: int | None = None,
        batch_size: int = 8,
        device: str = "auto",
        dtype: str = "float32",
        seed: int = 1234,
        apply_chat_template: bool = False,
        compression_scope: str = "prompt",
        progress=None,
        fidelity_tokens: int = 0,
        spec_prefill: dict | None = None,
        revision: str | None = None,
        device_map: str | dict | None = None,
        compile: bool | str = False,
        sync_every: int = 4,
        prefill_chunk: int | None = None,
        prefill_chunk_mode: str = "exact",
        **policy_params,
    ):
        super().__init__()
        if compression_scope not in SCOPES:
            raise ValueError(f"compression_scope must be one of {SCOPES}, got {compression_scope!r}")
        self.compression_scope = compression_scope
        self.context_unmarked = 0  # compression_scope=context: prompts without the end-of-context mark (compressed whole)
        if model is None:
            if pretrained is None:
                raise ValueError("give either pretrained=<hub id or path> or a loaded model")
            model, tokenizer = load_model(str(pretrained), dtype=dtype, device=device, revision=revision,
                                          device_map=device_map)
        if tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer")
        self.model, self.tokenizer = model, tokenizer
        self.stop_token_ids = ec.stop_token_ids(model, tokenizer)  # every EOS of the generation config and tokenizer
        self._stop_token_texts = set(tokenizer.convert_ids_to_tokens(self.stop_token_ids))
        self.max_context = int(max_context or getattr(model.config, "max_position_embeddings", 0) or 0)
        if self.max_context < 1:
            raise ValueError("max_context is needed when the model config has no max_position_embeddings")
        # lm_eval --model evalkit --model_args method=...,budget=...: checked as the evalkit CLI checks a config
        self.policy = policy or policy_from_config({"name": method, **policy_params}, budget, self.max_context)
        ec.model_spec.check_hookable(model)
        self.batch_size = int(batch_size)  # engine slots: sequences decoded together
        self.compile, self.sync_every = ec.compile_backend(compile), int(sync_every)
        self.prefill_chunk = None if prefill_chunk in (None, "", "null") else int(prefill_chunk)
        self.prefill_chunk_mode = str(prefill_chunk_mode)
        self._engine: ec.Engine | None = None
        self._geometry = None  # evalkit.memory's view of the model (False: it cannot price this one)
        self.seed = int(seed)
        self.use_chat_template = bool(apply_chat_template)
        self.chats: dict[str, list[dict]] = {}  # templated prompt -> its messages (to truncate before the template)
        self.request_stats: dict[tuple, dict] = {}  # (task, doc_id, repeat) -> that request's statistics
        # What this process measured of its own generations (resumed ones were measured by an earlier process).
        self.throughput = Throughput()
        self.progress = progress  # an evalkit.progress.Progress: finished generations survive a crash
        # > 0: also compare this many greedy tokens with a full-cache run (agreement, KL); no labels needed.
        self.fidelity_tokens = int(fidelity_tokens)
        self.spec_prefill = None
        if spec_prefill:  # a draft model picks the prompt tokens the target prefills
            settings = dict(spec_prefill)
            draft, draft_tokenizer = load_model(str(settings.pop("draft_model")), dtype=dtype, device=device,
                                                attn_implementation="eager")
            self.spec_prefill = ec.SpecPrefill(draft=draft, draft_tokenizer=draft_tokenizer, **settings)

    @property
    def device(self):
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """``lm_eval --model evalkit --model_args ...``: model_args win over lm-eval's own options. lm-eval fills
        ``device`` with ``cuda:0`` when none is given; without CUDA that default becomes ``auto`` (said once)."""
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k in ("batch_size", "device")}
        if str(extra.get("device", "")).startswith("cuda") and "device" not in args and not torch.cuda.is_available():
            print(f"evalkit: lm-eval's device {extra['device']} is not available here; running on the CPU "
                  "(pass --device cpu to silence this)", flush=True)
            extra["device"] = "auto"
        if str(extra.get("batch_size", "")).startswith("auto"):
            extra.pop("batch_size")  # evalkit has no batch size search; model_args batch_size=N sets it
        return cls(**{**extra, **args})

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        return cls.create_from_arg_string(",".join(f"{k}={v}" for k, v in arg_dict.items()), additional_config)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """The chat template over ``chat_history``. A final assistant message (lm-eval's ``gen_prefix``, such as R1's
        ``<think>\\n``) is continued verbatim after the generation prompt."""
        prefix = ""
        if not add_generation_prompt and chat_history and chat_history[-1]["role"] == "assistant":
            prefix, chat_history = chat_history[-1]["content"], chat_history[:-1]
        text = self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=True) + prefix
        self.chats[text] = [dict(message) for message in chat_history] + (
            [{"role": "assistant", "content": prefix}] if prefix else [])
        return text

    def _special_tokens(self, text: str) -> bool:
        """Whether tokenizing ``text`` should add the tokenizer's special tokens: not for chat-templated text, nor
        for text that already starts with BOS (templates such as Llama-3's write it; a second would shift every
        position)."""
        bos = self.tokenizer.bos_token
        return not (text in self.chats or (bos and text.startswith(bos)))

    def _truncate_raw(self, text: str, max_len: int) -> tuple[str, bool]:
        """LongBench's middle truncation of the raw prompt (the user turn when templated), then the template."""
        messages = self.chats.get(text)
        if messages is None:
            return truncate_middle(self.tokenizer, text, max_len)
        turn = max(i for i, m in enumerate(messages) if m["role"] == "user")
        content, truncated = truncate_middle(self.tokenizer, messages[turn]["content"], max_len)
        if not truncated:
            return text, False
        messages = [*messages[:turn], {**messages[turn], "content": content}, *messages[turn + 1 :]]
        prefix = messages.pop()["content"] if messages[-1]["role"] == "assistant" else ""
        return self.apply_chat_template(messages + ([{"role": "assistant", "content": prefix}] if prefix else []),
                                        add_generation_prompt=not prefix), True

    def _tokenize(self, text: str) -> tuple[list[int], int | None]:
        """The ids of ``text`` without its :data:`CONTEXT_END` mark, tokenized whole (as the official scripts send
        the prompt: a byte-level tokenizer merges across the mark, ``</text>\n\nWhat``), and the number of tokens
        before the mark: the tokens that start before it, found by character offsets (a token that straddles the
        mark belongs to the document). A tokenizer without offsets (a slow one) gives no boundary, or, where
        ``compression_scope=context`` needs one, is split in two pieces at the mark."""
        head, marker, tail = text.partition(CONTEXT_END)
        special = self._special_tokens(text)
        if not marker or not (self.tokenizer.is_fast or self.compression_scope == "context"):
            return self.tokenizer(head + tail, add_special_tokens=special)["input_ids"], None
        if not self.tokenizer.is_fast:
            ids = self.tokenizer(head, add_special_tokens=special)["input_ids"]
            return ids + self.tokenizer(tail, add_special_tokens=False)["input_ids"], len(ids)
        encoded = self.tokenizer(head + tail, add_special_tokens=special, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        text_tokens = [index for index, (start, end) in enumerate(offsets) if end > start]
        after = [index for index in text_tokens if offsets[index][0] >= len(head)]
        return ids, after[0] if after else (text_tokens[-1] + 1 if text_tokens else len(ids))

    # -- generation ------------------------------------------------------------------------------------------------
    def _encode(
        self, texts: list[str], reserve: int, truncation: str = "left"
    ) -> tuple[torch.Tensor, torch.Tensor, list[bool], list[int]]:
        """Left-padded ids of ``texts`` and, per text, how many leading tokens precede :data:`CONTEXT_END`.

        A prompt longer than max_context - ``reserve`` is cut: ``left`` keeps its end, ``middle`` keeps its first and
        last halves. (LongBench's own ``max_len`` cut happens earlier, on the raw prompt: :func:`truncate_middle`.)
        """
        limit = self.max_context - reserve
        if limit < 1:
            raise ValueError(f"max_context {self.max_context} leaves no room for the prompt after {reserve} new tokens")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        encoded, prefixes = [], []
        for text in texts:
            ids, prefix = self._tokenize(text)
            encoded.append(ids)
            prefixes.append(prefix)
        truncated = [len(ids) > limit for ids in encoded]
        for row, ids in enumerate(encoded):
            if not truncated[row]:
                continue
            cut = len(ids) - limit
            keep_head = limit // 2 if truncation == "middle" else 0
            encoded[row] = ids[:keep_head] + ids[keep_head + cut :]
            if prefixes[row] is not None:  # what the cut took from before the marker
                prefixes[row] -= min(cut, max(0, prefixes[row] - keep_head))
                prefixes[row] = prefixes[row] or None
        width = max(len(ids) for ids in encoded)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
        starts = [width - len(ids) + p if p is not None else None for ids, p in zip(encoded, prefixes)]
        return input_ids.to(self.device), mask.to(self.device), truncated, starts

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """All of a task's generation requests go to the engine at once; each finished one is recorded (and kept
        in the crash-safe progress file) as soon as it is done."""
        if not requests:
            return []
        keys = request_keys([(r.args[0], r.args[1]) for r in requests])
        owners = stats_keys(requests)
        outputs: list[str | None] = [None] * len(requests)
        for index, key in enumerate(keys):
            record = self.progress.get(key) if self.progress is not None else None
            if record is not None:  # generated before an interruption
                outputs[index] = record["text"]
                self.request_stats[owners[index]] = record["stats"]
        todo = [i for i in range(len(requests)) if outputs[i] is None]
        prepared = [self._prepare(requests[i].args[0], dict(requests[i].args[1]), keys[i]) for i in todo]
        meter = self.throughput
        meter.start(self.device)
        with tqdm(total=len(requests), initial=len(requests) - len(todo), desc="generate", disable=disable_tqdm) as bar:

            def finish(completion: ec.Completion) -> None:
                index = todo[completion.index]
                text, stats = self._finish(prepared[completion.index], completion)
                outputs[index] = text
                self.request_stats[owners[index]] = stats  # by request: requests finish in any order
                if self.progress is not None:
                    self.progress.add([{"key": keys[index], "text": text, "stats": stats}])
                meter.add(stats)
                bar.set_postfix_str(meter.describe(), refresh=False)
                bar.update(1)

            try:
                self.engine.run([item["request"] for item in prepared], on_finish=finish)
            finally:
                meter.stop(self._engine, self.model)
        return outputs

    @property
    def engine(self) -> ec.Engine:
        """The continuous-batching engine: ``batch_size`` slots, kept between calls (a compiled step stays compiled)."""
        if self._engine is None:
            self._engine = ec.Engine(self.model, self.policy, slots=self.batch_size, eos_token_id=self.stop_token_ids,
                                     tokenizer=self.tokenizer, compile=self.compile is not None,
                                     compile_backend=self.compile if self.compile != "inductor" else None,
                                     sync_every=self.sync_every, prefill_chunk=self.prefill_chunk,
                                     prefill_chunk_mode=self.prefill_chunk_mode)
        return self._engine

    def _prepare(self, text: str, gen_kwargs: dict, key: str) -> dict:
        """One lm-eval request as an engine request, plus what its text and statistics need afterwards."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new_tokens = int(gen_kwargs.pop("max_gen_toks", gen_kwargs.pop("max_new_tokens", 256)))
        do_sample = bool(gen_kwargs.pop("do_sample", False))
        temperature = gen_kwargs.pop("temperature", None)
        top_p = gen_kwargs.pop("top_p", None)
        if temperature == 0:
            do_sample, temperature = False, None
        if not do_sample:
            temperature = top_p = None
        truncation = gen_kwargs.pop("truncation", "left")
        max_len = gen_kwargs.pop("max_len", None)
        cut = False
        if truncation == "middle" and max_len:  # LongBench: on the raw prompt, before the chat template
            text, cut = self._truncate_raw(text, int(max_len))
        positions, spec_stats, compress_prefix = None, {}, None
        if self.spec_prefill is not None:
            # The draft reads the whole prompt; only the tokens it keeps reach the target, at their positions.
            special = self._special_tokens(text)
            input_ids, _, positions, (spec_stats,) = self.spec_prefill.select(
                [text.replace(CONTEXT_END, "")], self.tokenizer, self.tokenizer.pad_token_id,
                max_tokens=self.max_context - max_new_tokens, add_special_tokens=[special])
            truncated, positions = spec_stats["truncated"], positions[0]
        else:
            input_ids, _, (truncated,), (start,) = self._encode([text], max_new_tokens, truncation)
            compress_prefix = start if self.compression_scope == "context" else None
            self.context_unmarked += self.compression_scope == "context" and start is None
        stop_strings = [s for s in until if s and s not in self._stop_token_texts]  # those end it as tokens
        # The sampling stream comes from the request itself: reproducible whatever ran before or beside it.
        request = ec.Request(input_ids[0].cpu(), max_new_tokens=max_new_tokens, do_sample=do_sample,
                             temperature=temperature, top_p=top_p, stop_strings=stop_strings,
                             seed=self.seed + int(key[:8], 16), compress_prefix=compress_prefix, position_ids=positions)
        return {"request": request, "until": until, "truncated": truncated or cut, "spec": spec_stats}

    def _finish(self, prepared: dict, completion: ec.Completion) -> tuple[str, dict]:
        """The text lm-eval gets (cut at the first stop string) and the request's statistics."""
        decoded = self.tokenizer.decode(completion.tokens, skip_special_tokens=True)
        for stop in prepared["until"]:
            if stop and stop in decoded:
                decoded = decoded[: decoded.index(stop)]
        stats = {**completion.stats, "truncated": prepared["truncated"], "compression_scope": self.compression_scope,
                 "kv_bytes_predicted": self._predicted_bytes(prepared["request"], completion.stats),
                 "over_budget": self._over_budget(completion.stats)}
        if self.fidelity_tokens:
            ids = prepared["request"].input_ids[None].to(self.device)
            stats |= ec.fidelity(self.model, ids, self.policy, max_new_tokens=self.fidelity_tokens,
                                 eos_token_id=self.stop_token_ids)[0]
        spec = prepared["spec"]
        if spec:
            stats |= {"prompt_tokens": spec["prompt_tokens"], "spec_kept_tokens": spec["kept_tokens"],
                      "draft_seconds": spec["draft_seconds"]}
        return decoded, stats

    def _over_budget(self, stats: dict, tolerance: float = 0.01) -> bool | None:
        """Whether the request's cache held more than its policy's capacities allow (by more than ``tolerance``):
        the kept prompt tokens (mean over layers and heads: PyramidKV's and AdaKV's uneven shares average to the
        budget) against the prompt capacity, the peak against the cache capacity. None without a capacity."""
        prompt_cap, cache_cap = self.policy.prompt_capacity(), self.policy.cache_capacity()
        if prompt_cap is None and cache_cap is None:
            return None
        kept = stats.get("kept_prompt_tokens") or []
        mean_kept = sum(kept) / len(kept) if kept else 0.0
        return bool((prompt_cap is not None and mean_kept > prompt_cap * (1 + tolerance))
                    or (cache_cap is not None and float(stats["peak_cache_tokens"]) > cache_cap * (1 + tolerance)))

    def _predicted_bytes(self, request: ec.Request, measured: dict) -> float | None:
        """``evalkit.memory``'s price of this request's cache (the model's geometry read from its config, the
        policy's declared capacities), to hold the simulator to what the engine measured; None where it cannot
        price the model."""
        if self._geometry is None:
            from evalkit.memory.geometry import from_hf_config

            try:
                self._geometry = from_hf_config(self.model.config)
            except (ValueError, TypeError, AttributeError):
                self._geometry = False
        if not self._geometry:
            return None
        prompt = int(measured["prompt_tokens"])
        tail = prompt - request.compress_prefix if request.compress_prefix is not None else 0
        return float(self._geometry.request_kv_bytes(
            prompt, int(measured["generated_tokens"]), str(self.model.dtype).removeprefix("torch."),
            self.policy.prompt_capacity(), self.policy.cache_capacity(), uncompressed_tail=tail))

    # -- log-likelihood --------------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = []
        for request, owner in zip(tqdm(requests, desc="loglikelihood", disable=disable_tqdm), stats_keys(requests)):
            context, continuation = request.args
            value, greedy, self.request_stats[owner] = self._score(context, continuation)
            results.append((value, greedy))
        return results

    @torch.no_grad()
    def _score(self, context: str, continuation: str) -> tuple[float, bool, dict]:
        text = context.replace(CONTEXT_END, "")
        special = self._special_tokens(context)
        whole = self.tokenizer(text + continuation, add_special_tokens=special)["input_ids"]
        context_ids = self.tokenizer(text, add_special_tokens=special)["input_ids"]
        split = len(context_ids)
        if whole[:split] != context_ids or split >= len(whole):
            split = len(whole) - len(self.tokenizer(continuation, add_special_tokens=False)["input_ids"])
        if len(whole) > self.max_context:
            raise ValueError(f"context + continuation is {len(whole)} tokens, more than max_context {self.max_context}")
        ids = torch.tensor([whole], device=self.device)
        session = ec.CompressionSession(self.model, self.policy)
        first = session.prefill(ids[:, :split])
        rest = session.step(ids[:, split:-1])[0] if len(whole) - split > 1 else first[:0]
        logits = torch.cat([first, rest]).log_softmax(dim=-1)
        target = ids[0, split:]
        logprob = float(logits.gather(1, target[:, None]).sum())
        greedy = bool((logits.argmax(dim=-1) == target).all())
        return logprob, greedy, {"prompt_tokens": split, **session.realized(0)}

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "evalkit does not score rolling log-likelihood (perplexity) tasks: a compressed cache has no single "
            "meaning over a whole document. Use generation or log-likelihood tasks."
        )
