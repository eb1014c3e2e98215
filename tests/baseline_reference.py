"""Plain, independent definitions of the baseline methods, for exactness tests: one sequence, explicit loops, float64.

Each ``kept_*`` function names, per layer and KV head, the prompt positions a method keeps after prefill, from the
queries, keys and values the model produced in an ordinary full-cache run. ``simulate_decoding`` replays a
generation with a full cache, hiding every key the method's definition has evicted, and says which positions each
layer and head holds after every step.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from masked_reference import _RECORD, module_scaling, plain_snapkv_scores
from transformers import DynamicCache

import evalkit.compression as ec
from evalkit.compression.model_spec import cache_kwargs


def top(scores: list[float], count: int, offset: int = 0) -> set[int]:
    """Positions of the ``count`` best scores (ties to the earlier position), shifted by ``offset``."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return {offset + i for i in order[:count]}


@torch.no_grad()
def full_run(model, prompt: torch.Tensor) -> dict:
    """Per layer: post-RoPE queries [Hq, n, D], keys and values [Hkv, n, D], pre-RoPE queries [Hq, n, D] and keys
    [Hkv, n, D], and the attention's input hidden states [n, d_model]."""
    pre_rope, pre_rope_keys, hidden = {}, {}, {}
    hooks = []
    config = model.config
    heads, dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    dim = getattr(config, "head_dim", None) or dim
    for index, layer in enumerate(model.model.layers):
        def keep(module, inputs, output, index=index):
            pre_rope[index] = output[0].reshape(-1, heads, dim).transpose(0, 1).double()
        # The query just before RoPE: after q_norm where the family has one (Qwen3), else q_proj's output.
        source = getattr(layer.self_attn, "q_norm", None) or layer.self_attn.q_proj
        hooks.append(source.register_forward_hook(keep))

        def keep_key(module, inputs, output, index=index):
            pre_rope_keys[index] = output[0].reshape(output.shape[1], -1, dim).transpose(0, 1).double()
        source = getattr(layer.self_attn, "k_norm", None) or layer.self_attn.k_proj
        hooks.append(source.register_forward_hook(keep_key))

        def keep_hidden(module, args, kwargs, index=index):
            hidden[index] = kwargs.get("hidden_states", args[0] if args else None)[0].double()
        hooks.append(layer.self_attn.register_forward_pre_hook(keep_hidden, with_kwargs=True))
    original = model.config._attn_implementation
    model.config._attn_implementation = "reference_masked"
    _RECORD.clear()
    try:
        model(input_ids=prompt, **cache_kwargs(model, DynamicCache(config=config)), use_cache=True)
        return {
            layer: {"query": _RECORD["queries"][layer][0].double(), "key": _RECORD["keys"][layer][0].double(),
                    "value": _RECORD["values"][layer][0].double(), "pre_rope": pre_rope[layer],
                    "pre_rope_key": pre_rope_keys[layer], "hidden": hidden[layer]}
            for layer in _RECORD["queries"]
        }
    finally:
        model.config._attn_implementation = original
        _RECORD.clear()
        for hook in hooks:
            hook.remove()


def causal_probabilities(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """[n, n] softmax attention of one head's queries over its keys, causal."""
    logits = query @ key.T * scaling
    n = key.shape[0]
    for i in range(n):
        logits[i, i + 1 :] = float("-inf")
    return logits.softmax(dim=-1)


def group_mean(r, score) -> list[torch.Tensor]:
    """Per KV head, the mean over the query heads of its group of ``score(query_head, kv_head)``."""
    kv_heads = r["key"].shape[0]
    group = r["query"].shape[0] // kv_heads
    return [torch.stack([torch.as_tensor(score(h * group + g, h)) for g in range(group)]).mean(dim=0)
            for h in range(kv_heads)]


def kept_knorm(run, capacity):
    return {layer: [top((-k.norm(dim=-1)).tolist(), capacity) for k in r["key"]] for layer, r in run.items()}


# KNorm ranks by float32 key norms, each within about 1e-6 (relative) of the exact norm of a 16-dimensional key
# whatever order the CPU's kernels sum in: a cut between two norms closer than this would hang on rounding.
NORM_TOLERANCE = 1e-5


def smallest_norms(keys: torch.Tensor, candidates, count: int) -> set[int]:
    """The ``count`` of the positions ``candidates`` whose ``keys`` have the smallest norms (ties to the earlier
    position). The test's inputs must not put two norms within ``NORM_TOLERANCE`` at the cut: it says so if they
    do (a repeated token's keys, RoPE-rotated copies of one vector, have equal norms but for rounding)."""
    norms = {j: float(keys[j].norm()) for j in candidates}
    order = sorted(norms, key=lambda j: (norms[j], j))
    if 0 < count < len(order):
        inside, outside = order[count - 1], order[count]
        assert norms[outside] - norms[inside] > NORM_TOLERANCE * norms[outside], (
            f"positions {inside} and {outside}: key norms {norms[inside]} and {norms[outside]} tie up to rounding at "
            "the cut, where the kept set would hang on the CPU's float kernels")
    return set(order[:count])


def kept_random(run, capacity, seed):
    kept = {}
    for layer, r in run.items():
        draws = torch.rand(r["key"].shape[0], r["key"].shape[1], generator=torch.Generator().manual_seed(seed))
        kept[layer] = [top(d.tolist(), capacity) for d in draws]
    return kept


def kept_observed(run, capacity, scaling):
    kept = {}
    for layer, r in run.items():
        n = r["key"].shape[1]

        def observed(query_head, kv_head, r=r, n=n):
            p = causal_probabilities(r["query"][query_head], r["key"][kv_head], scaling)
            return [float(p[:, j].sum()) / (n - j) for j in range(n)]

        kept[layer] = [top(score.tolist(), capacity) for score in group_mean(r, observed)]
    return kept


def future_rotation(rotary, r, future: int) -> torch.Tensor:
    """RoPE as a matrix, averaged over the ``future`` positions after the prompt."""
    n, dim = r["key"].shape[1:]
    rotation = torch.zeros(dim, dim, dtype=torch.double)
    for position in range(n, n + future):
        cos, sin = rotary(r["key"][None].float(), torch.tensor([[position]]))
        cos, sin = cos[0, 0].double(), sin[0, 0].double()
        matrix = torch.diag(cos)
        for i in range(dim // 2):  # rotate_half: the first half takes -x2, the second half x1
            matrix[i, i + dim // 2] = -sin[i]
            matrix[i + dim // 2, i] = sin[i + dim // 2]
        rotation += matrix / future
    return rotation


def kept_expected(model, run, capacity, sink, future):
    return {layer: [set(range(sink)) | top(s.tolist(), capacity - sink, offset=sink) for s in scores]
            for layer, scores in expected_scores(model, run, sink, future).items()}


def expected_scores(model, run, sink, future, epsilon=0.0):
    """ExpectedAttention's scores per layer and KV head, of the tokens after the first ``sink``."""
    out = {}
    rotary = model.model.rotary_emb
    for layer, r in run.items():
        n, dim = r["key"].shape[1:]
        rotation = future_rotation(rotary, r, future)

        def expected(query_head, kv_head, r=r, rotation=rotation, dim=dim):
            queries = r["pre_rope"][query_head, sink:]
            mean = queries.mean(dim=0)
            centered = queries - mean
            covariance = centered.T @ centered / queries.shape[0]
            mean, covariance = rotation @ mean, rotation @ covariance @ rotation.T
            logits = torch.stack([k @ mean / math.sqrt(dim) + k @ covariance @ k / dim / 2 for k in r["key"][kv_head, sink:]])
            return logits.softmax(dim=0)

        out[layer] = [(s + epsilon) * r["value"][h, sink:].norm(dim=-1) for h, s in enumerate(group_mean(r, expected))]
    return out


def kept_tova(run, capacity, scaling):
    kept = {}
    for layer, r in run.items():
        kv_heads, n = r["key"].shape[:2]
        group = r["query"].shape[0] // kv_heads
        last = [causal_probabilities(r["query"][qh], r["key"][qh // group], scaling)[-1] for qh in range(kv_heads * group)]
        chosen = top(torch.stack(last).mean(dim=0).tolist(), capacity - 1)
        kept[layer] = [chosen for _ in range(kv_heads)]
    return kept


def kept_snapkv_budgets(run, budgets, window, kernel_size, pooling, scaling):
    """SnapKV with a budget per layer (PyramidKV) or the same budget everywhere."""
    kept = {}
    for layer, r in run.items():
        n = r["key"].shape[1]
        scores = plain_snapkv_scores(r["query"], r["key"], window, kernel_size, pooling, "mean", scaling)
        kept[layer] = [top(s.tolist(), budgets[layer] - window) | set(range(n - window, n)) for s in scores]
    return kept


def kept_adakv(run, capacity, window, kernel_size, pooling, alpha, scaling):
    def snapkv(layer, r):
        scores = plain_snapkv_scores(r["query"], r["key"], window, kernel_size, pooling, "mean", scaling).tolist()
        return [head + [float("inf")] * window for head in scores]

    return allocate_over_heads(run, capacity, alpha, snapkv)


def allocate_over_heads(run, capacity, alpha, head_scores):
    """AdaKV's allocation of ``capacity`` tokens per head on average: each head's own top ``int(capacity * alpha)``
    first, then the layer's best across heads. ``head_scores(layer, r)``: per KV head, a score per prompt position
    (``inf`` where the scorer forces the token)."""
    kept = {}
    for layer, r in run.items():
        kv_heads, n = r["key"].shape[:2]
        scores = head_scores(layer, r)
        safe = int(capacity * alpha)
        candidates = []
        for h in range(kv_heads):
            protected = top(scores[h], safe)
            candidates += [(float("inf") if j in protected else scores[h][j], h, j) for j in range(n)]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        heads = [set() for _ in range(kv_heads)]
        for _, h, j in candidates[: kv_heads * capacity]:
            heads[h].add(j)
        kept[layer] = heads
    return kept


def settings_of(method) -> dict:
    """A wrapped method as the plain definitions read it: its name and fields."""
    return {"name": method.name, **dataclasses.asdict(method)}


def scorer_head_scores(scorer: dict, scaling):
    """``head_scores`` of a wrapper's scorer, by its definition: KNorm (``-||k||``), ObservedAttention (attention
    received over the queries that see the key) or H2O (attention received, summed), the forced tokens at ``inf``."""
    name, sink = scorer["name"], scorer.get("sink", 0)
    window = scorer.get("recent") if name == "h2o" else scorer.get("window", 0)

    def head_scores(layer, r):
        n = r["key"].shape[1]
        if name == "knorm":
            scores = [(-k.norm(dim=-1)).tolist() for k in r["key"]]
        elif name == "observed_attention":
            def observed(query_head, kv_head):
                p = causal_probabilities(r["query"][query_head], r["key"][kv_head], scaling)
                return [float(p[:, j].sum()) / (n - j) for j in range(n)]
            scores = [score.tolist() for score in group_mean(r, observed)]
        elif name == "h2o":
            scores = h2o_prefill_scores(r, scaling)
        else:
            raise TypeError(name)
        forced = set(range(sink)) | set(range(n - window, n))
        return [[float("inf") if j in forced else head[j] for j in range(n)] for head in scores]

    return head_scores


def kept_budgets_over(run, budgets, head_scores):
    """Each layer keeps its budget of best tokens per head (PyramidKV over any scorer)."""
    return {layer: [top(head, budgets[layer]) for head in head_scores(layer, r)] for layer, r in run.items()}


def h2o_prefill_scores(r, scaling) -> list[list[float]]:
    def received(query_head, kv_head):
        return causal_probabilities(r["query"][query_head], r["key"][kv_head], scaling).sum(dim=0)

    return [score.tolist() for score in group_mean(r, received)]


def kept_h2o(run, capacity, recent, scaling):
    kept = {}
    for layer, r in run.items():
        n = r["key"].shape[1]
        kept[layer] = [top(s[: n - recent], capacity - 1 - recent) | set(range(n - recent, n))
                       for s in h2o_prefill_scores(r, scaling)]
    return kept


def kept_prompt(model, policy, prompt) -> dict[int, list[set[int]]]:
    """What ``policy`` keeps of ``prompt`` by its definition (prompts longer than its prompt capacity)."""
    run = full_run(model, prompt)
    scaling = module_scaling(model)
    if isinstance(policy, ec.KNorm):
        return kept_knorm(run, policy.capacity)
    if isinstance(policy, ec.Random):
        return kept_random(run, policy.capacity, policy.selection_seed)
    if isinstance(policy, ec.ObservedAttention):
        return kept_observed(run, policy.capacity, scaling)
    if isinstance(policy, ec.ExpectedAttention):
        return kept_expected(model, run, policy.capacity, policy.sink, policy.n_future_positions)
    if isinstance(policy, ec.TOVA):
        return kept_tova(run, policy.capacity, scaling)
    if isinstance(policy, ec.H2O):
        return kept_h2o(run, policy.capacity, policy.recent, scaling)
    if isinstance(policy, ec.AdaKV) and policy.scorer.name != "snapkv":
        return allocate_over_heads(run, policy.capacity, policy.alpha_safeguard,
                                   scorer_head_scores(settings_of(policy.scorer), scaling))
    if isinstance(policy, ec.AdaKV):
        snapkv = policy.scorer
        return kept_adakv(run, policy.capacity, snapkv.window, snapkv.kernel_size, snapkv.pooling,
                          policy.alpha_safeguard, scaling)
    raise TypeError(type(policy))


# -- decoding ----------------------------------------------------------------------------------------------------
def _pool(values: list[float], kernel_size: int, pooling: str) -> list[float]:
    half, out = kernel_size // 2, []
    for j in range(len(values)):
        neighbours = values[max(0, j - half) : j + half + 1]
        out.append(max(neighbours) if pooling == "max" else sum(neighbours) / kernel_size)
    return out


@torch.no_grad()
def simulate_decoding(model, policy, prompt: torch.Tensor, tokens: list[int], kept: dict[int, list[set[int]]]):
    """Feed ``tokens`` after ``prompt`` with a full cache, each layer and head seeing only what ``policy`` (H2O, TOVA,
    DecodingSnapKV, SnapKV-D or RaaS) still holds by its definition. Returns the logits of each step and, after each step, the
    positions held per layer and KV head."""
    scaling = module_scaling(model)
    run = full_run(model, prompt)
    held = {layer: [set(heads) for heads in per_head] for layer, per_head in kept.items()}
    sums = {}
    if isinstance(policy, ec.H2O):
        sums = {layer: [{j: s[j] for j in held[layer][h]} for h, s in enumerate(h2o_prefill_scores(r, scaling))]
                for layer, r in run.items()}
    windows = {layer: [] for layer in run}  # DecodingSnapKV: (position, queries [Hq, D]) of recent tokens
    return replay_decoding(model, prompt, tokens, held, lambda layer, per_head, query, keys, position, steps: _evict(
        policy, layer, per_head, query, keys, position, steps, scaling, sums, windows))


@torch.no_grad()
def replay_decoding(model, prompt: torch.Tensor, tokens: list[int], held: dict[int, list[set[int]]], evict):
    """Feed ``tokens`` after ``prompt`` with a full cache, each layer and KV head attending only to the positions
    ``held`` says (each new token added first); after each step ``evict(layer, per_head, query [Hq, D], keys [Hkv,
    position + 1, D], position, steps)`` (float64) updates ``held[layer]`` in place. Returns each step's logits and,
    after each step, the positions held per layer and KV head."""
    n = prompt.shape[1]
    original = model.config._attn_implementation
    model.config._attn_implementation = "reference_masked"
    cache = DynamicCache(config=model.config)
    logits, history = [], []
    try:
        _RECORD.clear()
        model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True)
        for step, token in enumerate(tokens):
            position = n + step
            for per_head in held.values():
                for heads in per_head:
                    heads.add(position)
            _RECORD["visible"] = {
                layer: torch.stack([torch.tensor([j in heads for j in range(position + 1)]) for heads in per_head])
                for layer, per_head in held.items()
            }
            out = model(input_ids=torch.tensor([[token]]), **cache_kwargs(model, cache), use_cache=True)
            logits.append(out.logits[0, -1].float())
            for layer, per_head in held.items():
                query = _RECORD["queries"][layer][0, :, 0].double()  # [Hq, D]
                keys = _RECORD["keys"][layer][0].double()  # [Hkv, position + 1, D]
                evict(layer, per_head, query, keys, position, step + 1)
            history.append({layer: [set(h) for h in per_head] for layer, per_head in held.items()})
        return torch.stack(logits), history
    finally:
        model.config._attn_implementation = original
        _RECORD.clear()


def _probabilities(query, keys, positions: list[int], scaling) -> list[float]:
    logits = torch.stack([query @ keys[j] * scaling for j in positions])
    return logits.softmax(dim=0).tolist()


def _evict(policy, layer, per_head, query, keys, position, steps, scaling, sums, windows):
    kv_heads = len(per_head)
    group = query.shape[0] // kv_heads
    if isinstance(policy, ec.H2O):
        for h, heads in enumerate(per_head):
            order = sorted(heads)
            probabilities = torch.tensor([_probabilities(query[h * group + g], keys[h], order, scaling)
                                          for g in range(group)]).mean(dim=0).tolist()
            for j, p in zip(order, probabilities):
                sums[layer][h][j] = sums[layer][h].get(j, 0.0) + p
            if len(heads) >= policy.capacity:
                heavy = [j for j in order if j <= position - policy.recent]
                victim = min(heavy, key=lambda j: (sums[layer][h][j], j))
                heads.discard(victim)
                del sums[layer][h][victim]
    elif isinstance(policy, ec.TOVA):
        order = sorted(per_head[0])
        mean = torch.tensor([_probabilities(query[qh], keys[qh // group], order, scaling)
                             for qh in range(kv_heads * group)]).mean(dim=0).tolist()
        if len(order) >= policy.capacity:
            victim = order[min(range(len(order)), key=lambda i: (mean[i], i))]
            for heads in per_head:
                heads.discard(victim)
    elif isinstance(policy, ec.RaaS):  # stamps: the last step that gave a token more than alpha of its attention
        stamps = sums.setdefault(layer, [{} for _ in range(kv_heads)])
        first = position - steps + 1
        for h, heads in enumerate(per_head):
            order = sorted(heads)
            probabilities = torch.tensor([_probabilities(query[h * group + g], keys[h], order, scaling)
                                          for g in range(group)]).mean(dim=0).tolist()
            for j, p in zip(order, probabilities):
                if p > policy.alpha or j == position:
                    stamps[h][j] = steps
            if len(heads) >= policy.capacity:
                generated = [j for j in order if j >= first]
                heads.discard(min(generated, key=lambda j: (stamps[h].get(j, 0), j)))
    elif isinstance(policy, ec.SnapKVD):  # the step's own attention over the tokens older than the window, pooled
        for h, heads in enumerate(per_head):
            order = sorted(heads)
            if len(order) < policy.capacity:
                continue
            prefix = [j for j in order if j <= position - policy.window]
            summed = [0.0] * len(prefix)
            for g in range(group):
                probabilities = _probabilities(query[h * group + g], keys[h], order, scaling)[: len(prefix)]
                pooled = _pool(probabilities, policy.kernel_size, policy.pooling)
                summed = [s + p / group for s, p in zip(summed, pooled)]
            heads.discard(prefix[min(range(len(prefix)), key=lambda i: (summed[i], i))])
    elif isinstance(policy, ec.DecodingSnapKV) and policy.scorer.name != "snapkv":  # re-applying KNorm (the only one here)
        assert policy.scorer.name == "knorm", policy.scorer
        if steps % policy.interval:
            return
        target, sink, window = policy.capacity - policy.interval, policy.scorer.sink, policy.scorer.window
        for h, heads in enumerate(per_head):
            order = sorted(heads)
            if len(order) <= target:
                continue
            forced = set(order[:sink]) | set(order[len(order) - window:] if window else ())
            others = smallest_norms(keys[h], [j for j in order if j not in forced], target - len(forced))
            heads.intersection_update(forced | others)
    else:  # DecodingSnapKV
        windows[layer] = (windows[layer] + [(position, query)])[-policy.window :]
        if steps % policy.interval:
            return
        target, window = policy.capacity - policy.interval, policy.window
        for h, heads in enumerate(per_head):
            order = sorted(heads)
            if len(order) <= target:
                continue
            first = position - window + 1
            prefix = [j for j in order if j < first]
            summed = [0.0] * len(prefix)
            for g in range(group):
                per_query = [0.0] * len(prefix)
                for query_position, queries in windows[layer]:
                    seen = [j for j in order if j <= query_position]
                    probabilities = _probabilities(queries[h * group + g], keys[h], seen, scaling)
                    for i, p in enumerate(probabilities[: len(prefix)]):
                        per_query[i] += p
                pooled = _pool(per_query, policy.scorer.kernel_size, policy.scorer.pooling)
                summed = [s + p / group for s, p in zip(summed, pooled)]
            keep = {prefix[i] for i in top(summed, target - window)}
            heads.intersection_update(keep | {j for j in order if j >= first})
