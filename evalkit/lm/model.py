"""The lm-eval model ``evalkit``: a transformers causal LM whose KV cache is compressed by a policy.

    lm_eval --model evalkit --model_args pretrained=PATH,method=snapstream,budget=4x,max_context=8192 \
        --include_path tasks/ --tasks kv_retrieval

This module only adapts lm-eval's requests to evalkit's and back (:mod:`evalkit.lm.requests`): prompts become ids
(:class:`evalkit.lm.prompts.PromptEncoder`); ``generate_until`` hands a task's requests to :class:`evalkit.compression.Engine`
(or its sessions to :mod:`evalkit.lm.sessions`); log-likelihood is scored against the compressed context
(:func:`evalkit.compression.score_continuation`); rolling log-likelihood is refused.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

import evalkit.compression as ec
from evalkit.benchmark import doc_to_question
from evalkit.config.method_config import policy_from_config
from evalkit.core.console import PhaseBar, stream
from evalkit.core.errors import ConfigError, RunError, model_unavailable
from evalkit.lm.context_fit import asked_truncation, check_fit, prepare_fitting
from evalkit.lm.parallel.sessions import answer_on_replicas
from evalkit.lm.prompts import PromptEncoder
from evalkit.lm.requests import check_model_arguments, finish_request, model_arguments
from evalkit.lm.sessions import generate_sessions
from evalkit.memory.measure import Throughput
from evalkit.memory.request_cost import RequestCost
from evalkit.models import load_model, load_spec_prefill
from evalkit.models.limits import check_model_limits
from evalkit.results.progress import request_keys, stats_keys


@register_model("evalkit")
class EvalkitLM(LM):
    """A transformers model plus a compression policy, as an lm-eval ``LM``. Per-request statistics of the realized
    compression go to ``request_stats`` by request (:func:`evalkit.results.progress.stats_keys`), finished generations
    to ``progress`` (:class:`evalkit.results.progress.Progress`: they survive a crash). ``fidelity_tokens`` > 0 also
    compares that many greedy tokens with a full-cache run (agreement, KL); ``spec_prefill`` (SpecPrefill's settings
    with ``draft_model``) lets a draft model pick the prompt tokens the target prefills."""

    def __init__(self, pretrained=None, model=None, tokenizer=None, policy: ec.Policy | None = None,
                 method: str = "full", budget: str | None = None, max_context: int | None = None, batch_size: int = 8,
                 device: str = "auto", dtype: str = "float32", seed: int = 1234, apply_chat_template: bool = False,
                 compression_scope: str = "prompt", progress=None, fidelity_tokens: int = 0,
                 spec_prefill: dict | None = None, revision: str | None = None, device_map: str | dict | None = None,
                 compile: bool | str = False, sync_every: int = 4, prefill_chunk: int | None = None,
                 prefill_chunk_mode: str = "exact", truncation: str | None = None, **policy_params):
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ConfigError("give either pretrained=<hub id or path> or a loaded model")
            try:
                model, tokenizer = load_model(str(pretrained), dtype=dtype, device=device, revision=revision,
                                              device_map=device_map)
            except OSError as error:  # one line, also under lm_eval --model evalkit
                raise RunError(model_unavailable(str(pretrained), error)) from None
        if tokenizer is None:
            raise ConfigError("a loaded model needs its tokenizer")
        self.model, self.tokenizer = model, tokenizer
        self.max_context = int(max_context or getattr(model.config, "max_position_embeddings", 0) or 0)
        if self.max_context < 1:
            raise ConfigError("max_context is needed when the model config has no max_position_embeddings")
        self.prompts = PromptEncoder(tokenizer, self.max_context, compression_scope)
        self.context_unmarked = 0  # compression_scope=context: prompts whose document's end is unknown (compressed whole)
        self.stop_token_ids = ec.stop_token_ids(model, tokenizer)  # every EOS of the generation config and tokenizer
        self.stop_token_texts = set(tokenizer.convert_ids_to_tokens(self.stop_token_ids))
        # lm_eval --model evalkit --model_args method=...,budget=...: checked as the evalkit CLI checks a config
        self.policy = policy or policy_from_config({"name": method, **policy_params}, budget, self.max_context)
        self.policy.bind_tokenizer(tokenizer)
        ec.model_spec.check_hookable(model)
        check_model_limits(model.config, self.policy, self.max_context, pretrained)  # layers, cache kind, positions
        self.cost = RequestCost(model, self.policy)
        self.batch_size, self.seed, self.use_chat_template = int(batch_size), int(seed), bool(apply_chat_template)
        self.compile, self.sync_every = ec.compile_backend(compile), int(sync_every)
        chunk = None if prefill_chunk in (None, "", "null") else int(prefill_chunk)
        self.prefill_chunk, self.prefill_chunk_mode = chunk, str(prefill_chunk_mode)
        self._engine: ec.Engine | None = None
        self.request_stats: dict[tuple, dict] = {}  # (task, doc_id, repeat) -> that request's statistics
        self.throughput = Throughput()  # what this process measured of its own generations (not resumed ones)
        self.progress, self.fidelity_tokens = progress, int(fidelity_tokens)
        self.spec_prefill = load_spec_prefill(spec_prefill, dtype, device) if spec_prefill else None
        self.mode, self.history, self.recompress = "single", "own", "never"  # task.mode, task.history, session.recompress
        self.truncation = asked_truncation(truncation)  # task.truncation (None: a prompt too long is refused)

    @property
    def device(self):
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        arguments = model_arguments(arg_string, additional_config, torch.cuda.is_available())
        check_model_arguments(arguments, cls.__init__)  # a mistake is said before the model loads
        return cls(**arguments)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        return cls.create_from_arg_string(",".join(f"{k}={v}" for k, v in arg_dict.items()), additional_config)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.prompts.apply_chat_template(chat_history, add_generation_prompt)

    def use_replicas(self, pool) -> None:
        """Generate on ``pool`` (:class:`evalkit.lm.parallel.pool.ReplicaPool`) instead of an engine of this process;
        finished requests are recorded here as they arrive, as from one engine."""
        from evalkit.lm.parallel.throughput import ReplicaThroughput

        self._engine, self.throughput = pool, ReplicaThroughput()

    def close(self) -> None:
        """Release what generation holds beyond this process (a replica pool's actors)."""
        close = getattr(self._engine, "close", None)
        if close is not None:
            close()

    # -- generation ------------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """All of a task's generation requests go to the engine at once; each finished one is recorded (and kept
        in the crash-safe progress file) as soon as it is done."""
        if not requests:
            return []
        if self.mode != "single":
            if hasattr(self._engine, "run_sessions"):  # parallel=ray: whole sessions on the replicas, recorded here
                answer_on_replicas(self, requests, self.mode, self.history, disable_tqdm)
            return generate_sessions(self, requests, self.mode, self.history, disable_tqdm)
        keys = request_keys([(r.args[0], r.args[1]) for r in requests])
        owners, outputs = stats_keys(requests), [None] * len(requests)  # outputs: a text per request once generated
        for index, key in enumerate(keys):
            record = self.progress.get(key) if self.progress is not None else None
            if record is not None:  # generated before an interruption
                outputs[index] = record["text"]
                self.request_stats[owners[index]] = record["stats"]
        todo = [i for i in range(len(requests)) if outputs[i] is None]
        prepared = [self._prepare(*requests[i].args[:2], keys[i], self._question(requests[i])) for i in todo]
        check_fit(self, [requests[i].args[0] for i in todo], prepared, getattr(requests[0], "task_name", "?"))
        meter = self.throughput
        meter.start(self.device)
        with PhaseBar(len(requests), len(requests) - len(todo), disable=disable_tqdm) as bar:

            def finish(completion: ec.Completion) -> None:
                index = todo[completion.index]
                text, stats = finish_request(self, prepared[completion.index], completion)
                outputs[index] = text
                self.request_stats[owners[index]] = stats  # by request: requests finish in any order
                if self.progress is not None:
                    self.progress.add([{"key": keys[index], "text": text, "stats": stats}])
                meter.add(stats)
                bar.update(1)

            try:
                self.engine.run([item["request"] for item in prepared], on_finish=finish, on_step=bar.step)
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

    def _question(self, request) -> str | None:
        """With compression_scope=context, the text that follows the document in ``request``'s prompt: its task's
        ``doc_to_question`` hook on the request's doc (:func:`evalkit.benchmark.doc_to_question`); None: unknown."""
        if self.prompts.compression_scope != "context":
            return None
        hook = doc_to_question(request.task_name)
        return hook(request.doc) if hook is not None else None

    def _prepare(self, text: str, gen_kwargs: dict, key: str, question: str | None = None) -> dict:
        """One lm-eval request as an engine request (:func:`evalkit.lm.requests.prepare_request`); ``question``: the
        text that follows the prompt's document (:meth:`_question`), cut only as asked (:mod:`.context_fit`)."""
        return prepare_fitting(self, text, gen_kwargs, key, question)

    # -- log-likelihood --------------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = []
        for request, owner in zip(tqdm(requests, desc="loglikelihood", file=stream(), disable=disable_tqdm), stats_keys(requests)):
            ids, split = self.prompts.encode_pair(*request.args)
            value, greedy, self.request_stats[owner] = ec.score_continuation(self.model, self.policy, ids, split)
            results.append((value, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "evalkit does not score rolling log-likelihood (perplexity) tasks: a compressed cache has no single "
            "meaning over a whole document. Use generation or log-likelihood tasks."
        )
