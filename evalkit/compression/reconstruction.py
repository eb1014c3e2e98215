"""A method's passes of its own after the prefill (``extra_passes``: KVzip's context reconstruction).

The prompt's prefill leaves every layer whole (the cache defers their compression). Then, one row at a time, the
model runs each of the policy's passes (:meth:`passes`: inputs of its own after the row's prompt) over a cache that
holds the row's prompt as views of the session's tensors: each layer's attention goes to :meth:`pass_scores`, which
scores a span of the prompt, and the layer's pass tokens are dropped as soon as it is scored, so a pass holds one
layer's copy at a time beside the whole prompt. With every span scored, :meth:`allocate_layers` sizes every layer
and KV head of the row at once and each layer keeps its best tokens. The bytes the passes hold count in the prefill's
peak (``kv_bytes_prefill_peak``).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer

from . import prefill_store
from .attention import hooked, recording_inputs
from .methods.base import best_in_order
from .model_spec import cache_kwargs
from .prefill_store import RecordedScores


class PassCache(Cache):
    """One row's prompt, as views of the session's layers; a pass's tokens are appended and dropped again."""

    def __init__(self, prompt: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(layers=[DynamicLayer() for _ in prompt])
        self.prompt = prompt
        self.reset()

    def reset(self, layer_idx: int | None = None) -> None:
        """Back to the prompt alone: every layer, or ``layer_idx``."""
        for index in range(len(self.layers)) if layer_idx is None else (layer_idx,):
            layer = self.layers[index]
            layer.keys, layer.values = self.prompt[index]
            layer.device, layer.dtype, layer.is_initialized = layer.keys.device, layer.keys.dtype, True

    def pass_bytes(self) -> int:
        """Bytes the layers hold beyond the prompt's views (their copies with a pass's tokens)."""
        return sum(t.numel() * t.element_size() for layer, held in zip(self.layers, self.prompt)
                   for t, view in zip((layer.keys, layer.values), held) if t is not view)


class PassObserver:
    """Handed to the attention hook as the model call's cache argument during a pass: each layer's attention is
    scored by the policy, then the layer's pass tokens go."""

    extra_pass = True  # what the hook recognises

    def __init__(self, session, pass_cache: PassCache, scores: torch.Tensor, row: int, first: int, start: int,
                 end: int, inputs: dict):
        self.session, self.pass_cache, self.scores, self.row = session, pass_cache, scores, row
        self.first, self.start, self.end, self.inputs = first, start, end, inputs

    def observe(self, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> None:
        layer_idx = module.layer_idx
        cache = self.session.cache
        cache.count_held_bytes(self.pass_cache.pass_bytes())
        hidden = self.inputs.pop(layer_idx, [None])[-1]
        span = cache.policy.pass_scores(module, query, keys, values, hidden, scaling, self.start, self.end)
        if span is not None:  # (None: the policy writes the layer's span once its pass is over, as KVgrad does)
            self.write(layer_idx, span)
        self.pass_cache.reset(layer_idx)

    def write(self, layer_idx: int, span: torch.Tensor) -> None:
        """The scores ``[1, Hkv, end - start]`` of this pass's span of the prompt in layer ``layer_idx``."""
        self.scores[layer_idx, self.row, :, self.first + self.start : self.first + self.end] = span.float()[0]


def run_pass(model, call, observer: PassObserver) -> None:
    """A pass as the model call ``call()`` alone, each layer scored as its attention runs; a policy with a
    ``run_pass(model, call, observer)`` of its own runs its passes so (KVgrad: a backward pass after each)."""
    call()


@torch.no_grad()
def compress_by_passes(session, input_ids: torch.Tensor, key_valid: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor | None:
    """Run the policy's passes over every row's prompt and compress every deferred layer (see the module); how
    many positions each row's appended tokens take after its prompt ``[B]`` (None: the policy appends none)."""
    cache, model, policy = session.cache, session.model, session.policy
    layers = cache.layers
    batch, n = input_ids.shape
    shared = cache.plan.compress and policy.budget_free_passes and not getattr(policy, "appends", False)
    store = prefill_store.active() if shared else None
    key = store.passes_key(store.key(model, input_ids, key_valid, positions), policy) if store else None
    recorded = store.get(key, model) if key else None
    if recorded is not None:  # another budget of this method scored this prompt already
        scores = recorded.scores.clone()
        cache.prefill_peak_bytes = max(cache.prefill_peak_bytes, recorded.peak_bytes)
    else:
        scores = torch.zeros(len(layers), batch, layers[0].keys.shape[1], n, device=layers[0].keys.device)
    inputs: dict[int, list[torch.Tensor]] = {}
    appended: dict[int, tuple | None] = {}  # row: (first position, each layer's keys and values) of its own tokens
    for row in range(batch if cache.plan.compress and recorded is None else 0):  # (nothing to compress: all kept)
        first = n - int(key_valid[row].sum())
        prompt = [(layer.keys[row : row + 1, :, first:], layer.values[row : row + 1, :, first:]) for layer in layers]
        pass_cache = PassCache(prompt)
        after = int(positions[row].max()) + 1  # a pass goes on from the prompt's last position
        for start, end, ids in policy.passes(input_ids[row, first:]):
            ids = ids.to(input_ids.device)[None]
            observer = PassObserver(session, pass_cache, scores, row, first, start, end, inputs)
            call = functools.partial(model, input_ids=ids, position_ids=after + torch.arange(ids.shape[1],
                                     device=ids.device)[None], use_cache=True, logits_to_keep=1, evalkit_cache=observer,
                                     **cache_kwargs(model, pass_cache))
            with hooked(model), recording_inputs(model, inputs):
                getattr(policy, "run_pass", run_pass)(model, call, observer)
            pass_cache.reset()
        if getattr(policy, "appends", False):
            appended[row] = append_pass(session, pass_cache, after)
    if key is not None and recorded is None:
        store.put(key, RecordedScores(weakref.ref(model), scores.clone(), cache.prefill_peak_bytes))
    scores = scores.masked_fill(~key_valid.to(scores.device)[None, :, None], float("-inf"))
    scores, counts = policy.allocate_layers(scores, key_valid.sum(dim=1).to(scores.device))  # counts [L, B, Hkv]
    added = None
    if any(tokens is not None for tokens in appended.values()):
        scores, counts, added = join_appended(cache, appended, scores, counts)
    deferred, cache.deferred = cache.deferred, {}
    for layer_idx, (module, scaling) in sorted(deferred.items()):
        layer = layers[layer_idx]
        query = layer.keys.new_empty(batch, 0, 0, layer.keys.shape[-1])
        view = cache._view(layer_idx, module, query, layer.keys, layer.values, scaling)
        indices = best_in_order(scores[layer_idx], counts[layer_idx])
        cache.keep(layer_idx, view, query, indices, counts[layer_idx], scores[layer_idx])
    return added


class AppendObserver:
    """Handed to the attention hook while a policy's own tokens run after a row's prompt (RestoreKV's restore tokens):
    each layer's keys and values of them are kept, then the layer's pass tokens go."""

    extra_pass = True

    def __init__(self, session, pass_cache: PassCache, count: int):
        self.session, self.pass_cache, self.count, self.kept = session, pass_cache, count, {}

    def observe(self, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> None:
        self.session.cache.count_held_bytes(self.pass_cache.pass_bytes())
        self.kept[module.layer_idx] = (keys[:, :, -self.count :].clone(), values[:, :, -self.count :].clone())
        self.pass_cache.reset(module.layer_idx)


def append_pass(session, pass_cache: PassCache, after: int) -> tuple | None:
    """The policy's own tokens (``appended_embeddings``) run once over the row's whole prompt from position ``after``
    on, as the policy has the model then (``appending``): ``(after, [each layer's (keys, values) [1, Hkv, count,
    D]])``, or None where the row takes none."""
    model, policy = session.model, session.policy
    embeddings = policy.appended_embeddings(model, pass_cache.prompt[0][0].shape[-2])
    if embeddings is None:
        return None
    observer = AppendObserver(session, pass_cache, embeddings.shape[0])
    position_ids = after + torch.arange(embeddings.shape[0], device=embeddings.device)[None]
    with hooked(model), policy.appending(model):
        model(inputs_embeds=embeddings[None], position_ids=position_ids, use_cache=True, logits_to_keep=1,
              evalkit_cache=observer, **cache_kwargs(model, pass_cache))
    pass_cache.reset()
    return after, [observer.kept[index] for index in range(len(pass_cache.layers))]


def join_appended(cache, appended: dict, scores: torch.Tensor, counts: torch.Tensor) -> tuple:
    """Every layer's prompt followed by the rows' appended tokens (empty, invalid slots in a row without them),
    scored to be kept on top of ``counts``: the scores, the counts and how many positions each row's appended
    tokens take ``[B]``."""
    plan, batch = cache.plan, scores.shape[1]
    count = next(tokens for tokens in appended.values() if tokens is not None)[1][0][0].shape[-2]
    rows = torch.tensor([appended.get(row) is not None for row in range(batch)], device=plan.key_valid.device)
    first = torch.tensor([tokens[0] if tokens is not None else 0 for tokens in map(appended.get, range(batch))],
                         device=plan.positions.device)
    cache.plan = dataclasses.replace(plan, key_valid=torch.cat([plan.key_valid, rows[:, None].expand(-1, count)], 1),
                                     positions=torch.cat([plan.positions, first[:, None] + torch.arange(
                                         count, device=first.device)], 1))
    for index, layer in enumerate(cache.layers):
        keys = layer.keys.new_zeros(*layer.keys.shape[:2], count, layer.keys.shape[-1])
        values = layer.values.new_zeros(*layer.values.shape[:2], count, layer.values.shape[-1])
        for row, tokens in appended.items():
            if tokens is not None:
                keys[row], values[row] = tokens[1][index][0][0], tokens[1][index][1][0]
        layer.keys, layer.values = torch.cat([layer.keys, keys], dim=2), torch.cat([layer.values, values], dim=2)
    cache.count_held_bytes()
    kept = rows.to(scores.device)[None, :, None, None].expand(*scores.shape[:3], count)
    scores = torch.cat([scores, torch.where(kept, float("inf"), float("-inf"))], dim=-1)
    added = rows.to(counts.device).long() * count
    return scores, counts + added[None, :, None], added
