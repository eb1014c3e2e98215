"""Plain definitions of the zoo's methods (leverage, non-causal attention, Compactor, Q-Filters, ChunkKV, CriticalKV,
CriticalAdaKV, SimLayerKV, DuoAttention, block-wise and chunk-wise scoring), written from their references (kvpress
0.5.5's presses, the papers) for one unpadded sequence: explicit loops, float64, from the queries, keys and values of
an ordinary full-cache run (baseline_reference.full_run). Each ``kept_*`` names, per layer, the positions each KV head
keeps."""

from __future__ import annotations

import math

import torch
from baseline_reference import causal_probabilities, future_rotation, top
from masked_reference import plain_snapkv_scores

from evalkit.compression.model_spec import cache_kwargs

TOP = torch.finfo(torch.float32).max


def z(scores: list[list[float]]) -> list[list[float]]:
    flat = [s for head in scores for s in head]
    mean = sum(flat) / len(flat)
    std = max(math.sqrt(sum((s - mean) ** 2 for s in flat) / (len(flat) - 1)), 1e-6)
    return [[(s - mean) / std for s in head] for head in scores]


def leverage(pre_keys: torch.Tensor, layer: int, size: int, seed: int) -> list[list[float]]:
    """Per KV head: x_j^T (X^T X + 0.01 I)^-1 x_j of the centred keys X sketched by the layer's projection."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(layer + 1):
        projection = torch.randn(1, pre_keys.shape[0], pre_keys.shape[2], size, generator=generator)[0].double()
    projection = projection / math.sqrt(size)
    out = []
    for head, keys in enumerate(pre_keys):
        x = (keys - keys.mean(dim=0)) @ projection[head]
        gram = x.T @ x + 0.01 * torch.eye(size, dtype=torch.double)
        out.append([max(0.0, float(row @ torch.linalg.solve(gram, row))) for row in x])
    return out


def non_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int) -> list[list[float]]:
    """Per KV head: attention received within chunks (no mask, no scaling; the last chunk padded with zero vectors:
    padded keys at logit -1e-9, padded queries all logits 0), mean over the group, times ||v||, averaged over 3
    neighbours (zeros beyond the ends)."""
    q_heads, n, _ = query.shape
    kv_heads = key.shape[0]
    group = q_heads // kv_heads
    padded = math.ceil(n / chunk) * chunk
    out = []
    for kv_head in range(kv_heads):
        received = [0.0] * n
        for g in range(group):
            q = query[kv_head * group + g]
            for start in range(0, padded, chunk):
                for i in range(start, start + chunk):
                    logits = [(float(q[i] @ key[kv_head][j]) if i < n else 0.0) if j < n else -1e-9
                              for j in range(start, start + chunk)]
                    weights = torch.tensor(logits, dtype=torch.double).softmax(dim=0)
                    for offset, j in enumerate(range(start, min(start + chunk, n))):
                        received[j] += float(weights[offset]) / group
        scores = [r * float(value[kv_head][j].norm()) for j, r in enumerate(received)]
        out.append([(sum(scores[max(0, j - 1) : j + 2])) / 3 for j in range(n)])
    return out


def kept_leverage(run, capacity, size=48, seed=0):
    return {layer: [top(head, capacity) for head in leverage(r["pre_rope_key"], layer, size, seed)]
            for layer, r in run.items()}


def kept_non_causal(run, capacity, chunk):
    return {layer: [top(head, capacity) for head in non_causal(r["query"], r["key"], r["value"], chunk)]
            for layer, r in run.items()}


def kept_compactor(run, capacity, chunk, sink=8, window=4, size=48, seed=0):
    kept = {}
    for layer, r in run.items():
        n = r["key"].shape[1]
        middle = slice(sink, n - window)
        lev = z(leverage(r["pre_rope_key"][:, middle], layer, size, seed))
        att = z(non_causal(r["query"][:, middle], r["key"][:, middle], r["value"][:, middle], chunk))
        blending = 1 - capacity / n
        forced = set(range(sink)) | set(range(n - window, n))
        kept[layer] = [forced | top([blending * a + b for a, b in zip(la, at)], capacity - sink - window, sink)
                       for la, at in zip(lev, att)]
    return kept


def kept_qfilter(run, capacity, filters):
    return {layer: [top([-float(filters[layer, h] @ k) for k in keys], capacity) for h, keys in enumerate(r["key"])]
            for layer, r in run.items()}


def snapkv_with_window(r, window, kernel, scaling) -> list[list[float]]:
    """kvpress' SnapKVPress scores: average pooling, group mean, the window at the best score + 1."""
    scores = plain_snapkv_scores(r["query"], r["key"], window, kernel, "avg", "mean", scaling).double().tolist()
    best = max(s for head in scores for s in head) + 1
    return [head + [best] * window for head in scores]


def kept_chunkkv(run, capacity, window, kernel, length, scaling):
    kept = {}
    for layer, r in run.items():
        scores = snapkv_with_window(r, window, kernel, scaling)
        n = len(scores[0])
        total = [sum(head[j] for head in scores) for j in range(n)]
        chunks = [total[start : start + length] for start in range(0, n, length)]
        means = [sum(c) / len(c) for c in chunks]
        best = top(means, capacity // length)
        chosen = {j for c in best for j in range(c * length, min((c + 1) * length, n))}
        kept[layer] = [chosen for _ in scores]
    return kept


def projected_norms(r, o_proj: torch.Tensor) -> list[list[float]]:
    """Per KV head: ||W_o^h v||_1 per token, averaged over the group's query heads h."""
    kv_heads, n, dim = r["value"].shape
    q_heads = r["query"].shape[0]
    group = q_heads // kv_heads
    weight = o_proj.detach().double()  # [hidden, Hq * D]
    return [[sum(float((weight[:, h * dim : (h + 1) * dim] @ r["value"][kv][j]).abs().sum())
                 for h in range(kv * group, (kv + 1) * group)) / group for j in range(n)] for kv in range(kv_heads)]


def kept_criticalkv(run, model, capacity, window, kernel, scaling, epsilon=1e-4, ratio=0.5):
    kept = {}
    for layer, r in run.items():
        n = r["key"].shape[1]
        scores = [[s / window for s in head] for head in snapkv_with_window(r, window, kernel, scaling)]  # kvpress' mean
        norms = projected_norms(r, model.model.layers[layer].self_attn.o_proj.weight)
        heads = []
        for head, norm in zip(scores, norms):
            first = top(head, max(1, int(capacity * ratio)))
            final = [TOP if j in first else (head[j] + epsilon) * norm[j] for j in range(n)]
            heads.append(top(final, capacity))
        kept[layer] = heads
    return kept


def kept_criticaladakv(run, model, capacity, window, kernel, scaling, alpha=0.2, epsilon=1e-4, ratio=0.5):
    """kvpress CriticalAdaKVPress step by step: safeguard, head budgets, first stage, projected norms."""
    kept = {}
    for layer, r in run.items():
        kv_heads, n = r["key"].shape[:2]
        scores = [[s / window for s in head] for head in snapkv_with_window(r, window, kernel, scaling)]  # kvpress' mean
        scores = [[math.inf if j >= n - window else s for j, s in enumerate(head)] for head in scores]
        safe = max(1, int(capacity * alpha))
        for head in scores:
            for j in top(head, safe):
                head[j] = TOP
        ranked = sorted(((-s, h, j) for h, head in enumerate(scores) for j, s in enumerate(head)))
        budgets = [0] * kv_heads
        for _, h, _ in ranked[: kv_heads * capacity]:
            budgets[h] += 1
        norms = projected_norms(r, model.model.layers[layer].self_attn.o_proj.weight)
        heads = []
        for head, norm, budget in zip(scores, norms, budgets):
            first = top(head, int(budget * ratio))
            final = [TOP if j in first or head[j] == TOP else (head[j] + epsilon) * norm[j] for j in range(n)]
            heads.append(top(final, budget))
        kept[layer] = heads
    return kept


def simlayerkv_attention(r, n_last, n_initial, n_recent, scaling) -> float:
    """The attention the last ``n_last`` queries give the first and the recent keys before them (mean over heads
    and those queries)."""
    n = r["key"].shape[1]
    kv_heads, q_heads = r["key"].shape[0], r["query"].shape[0]
    rows = []
    for qh in range(q_heads):
        p = causal_probabilities(r["query"][qh], r["key"][qh // (q_heads // kv_heads)], scaling)
        rows += [p[i, : n - n_last] for i in range(n - n_last, n)]
    mean = torch.stack(rows).mean(dim=0)
    return float(mean[:n_initial].sum() + mean[-n_recent:].sum())


def kept_simlayerkv(run, threshold, n_last, n_initial, n_recent, scaling):
    kept = {}
    for layer, r in run.items():
        kv_heads, n = r["key"].shape[:2]
        lazy = simlayerkv_attention(r, n_last, n_initial, n_recent, scaling) > threshold
        chosen = set(range(n_initial)) | set(range(n - n_recent + n_last, n)) if lazy else set(range(n))
        kept[layer] = [chosen for _ in range(kv_heads)]
    return kept


def keydiff(keys: torch.Tensor) -> list[float]:
    unit = [k / k.norm() for k in keys]
    anchor = sum(unit) / len(unit)
    return [-float(k @ anchor / (k.norm() * anchor.norm())) for k in keys]


def kept_blockwise_keydiff(run, capacity, block):
    kept = {}
    for layer, r in run.items():
        n = r["key"].shape[1]
        heads = []
        for keys in r["key"]:
            held = list(range(capacity))
            for start in range(capacity, n, block):
                candidates = held + list(range(start, min(start + block, n)))
                scores = keydiff(keys[candidates])
                order = sorted(range(len(candidates)), key=lambda i: (-scores[i], i))
                held = [candidates[i] for i in order[:capacity]]
            heads.append(set(held))
        kept[layer] = heads
    return kept


def kept_chunkwise_snapkv(run, capacity, length, window, kernel, scaling):
    kept = {}
    for layer, r in run.items():
        n = r["key"].shape[1]
        heads = [set() for _ in range(r["key"].shape[0])]
        for start in range(0, n, length):
            end = min(start + length, n)
            keep = max(1, (end - start) * capacity // n)
            if keep >= end - start:
                for head in heads:
                    head |= set(range(start, end))
                continue
            scores = plain_snapkv_scores(r["query"][:, start:end], r["key"][:, start:end], window, kernel, "avg",
                                         "mean", scaling).tolist()
            for head, s in zip(heads, scores):
                head |= top(s, keep - window, start) | set(range(end - window, end))
        kept[layer] = heads
    return kept


def kept_capkv(model, run, capacity, sink=4, tau=5.0, future=512, epsilon=1e-6):
    """kvpress CapPress per query head: w_i = exp(tau cos(k_i, R mean(q)) - max), A = I + sum (w_i + eps) v_i v_i^T,
    score w_i v_i^T A^-1 v_i, mean over the group; the first ``sink`` tokens kept."""
    kept = {}
    for layer, r in run.items():
        kv_heads, n, dim = r["key"].shape
        group = r["query"].shape[0] // kv_heads
        rotation = future_rotation(model.model.rotary_emb, r, future)
        heads = []
        for kv in range(kv_heads):
            keys, values = r["key"][kv, sink:], r["value"][kv, sink:]
            total = torch.zeros(n - sink, dtype=torch.double)
            for qh in range(kv * group, (kv + 1) * group):
                anchor = rotation @ r["pre_rope"][qh, sink:].mean(dim=0)
                cosines = [float(k @ anchor / (k.norm() * anchor.norm())) for k in keys]
                weights = [math.exp(tau * c - tau * max(cosines)) for c in cosines]
                capacity_matrix = torch.eye(dim, dtype=torch.double)
                for w, v in zip(weights, values):
                    capacity_matrix += (w + epsilon) * torch.outer(v, v)
                inverse = torch.linalg.inv(capacity_matrix)
                total += torch.tensor([w * float(v @ inverse @ v) for w, v in zip(weights, values)]) / group
            heads.append(set(range(sink)) | top(total.tolist(), capacity - sink, sink))
        kept[layer] = heads
    return kept


def kvzap_scores(hidden: torch.Tensor, tensors: dict, layer: int, mlp: bool) -> list[list[float]]:
    """Per KV head: the layer's surrogate applied to each token's hidden state (GELU with erf)."""
    def linear(name, x):
        return tensors[f"layers.{layer}.{name}weight"].double() @ x + tensors[f"layers.{layer}.{name}bias"].double()

    def gelu(x):
        return torch.tensor([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x.tolist()], dtype=torch.double)

    out = [linear("2.", gelu(linear("0.", h))) if mlp else linear("", h) for h in hidden]
    return [[float(o[head]) for o in out] for head in range(len(out[0]))]


def kept_kvzap(run, capacity, tensors, mlp):
    return {layer: [top(head, capacity) for head in kvzap_scores(r["hidden"], tensors, layer, mlp)]
            for layer, r in run.items()}


def kept_threshold_kvzap(run, threshold, window, tensors, mlp):
    """kvpress DMSPress in prefill: per head, tokens before the last ``window`` scoring below ``threshold`` go."""
    kept = {}
    for layer, r in run.items():
        n = r["key"].shape[1]
        kept[layer] = [{j for j, s in enumerate(head) if s >= threshold or j >= n - window}
                       for head in kvzap_scores(r["hidden"], tensors, layer, mlp)]
    return kept


def kept_snapkv_avg(run, capacity, window, kernel, scaling):
    """kvpress' SnapKVPress kept positions per layer and head (the inline scorer of the wrappers), in text order."""
    return {layer: [sorted(top(head, capacity)) for head in snapkv_with_window(r, window, kernel, scaling)]
            for layer, r in run.items()}


def rope(model, vector: torch.Tensor, position: int) -> torch.Tensor:
    """RoPE of one pre-RoPE vector at ``position``: v cos + rotate_half(v) sin, in float64."""
    cos, sin = model.model.rotary_emb(vector[None, None].float(), torch.tensor([[position]]))
    cos, sin = cos[0, 0].double(), sin[0, 0].double()
    half = vector.shape[0] // 2
    return vector * cos + torch.cat([-vector[half:], vector[:half]]) * sin


def rerotated_keys(model, run, kept):
    """Per layer and head: the kept pre-RoPE keys re-rotated to positions 0, 1, ... in text order."""
    return {layer: [torch.stack([rope(model, r["pre_rope_key"][h, p], i) for i, p in enumerate(kept[layer][h])])
                    for h in range(len(kept[layer]))] for layer, r in run.items()}


def merged_values(run, kept, threshold=0.0, fraction=1.0, eps=1e-6):
    """kvpress MergingPress.merge per head: each evicted value folded into its most key-cosine-similar kept one."""
    out = {}
    for layer, r in run.items():
        heads = []
        for h, chosen in enumerate(kept[layer]):
            keys, values = r["key"][h], r["value"][h]
            evicted = [p for p in range(keys.shape[0]) if p not in set(chosen)]
            unit = [keys[p] / max(float(keys[p].norm()), eps) for p in range(keys.shape[0])]
            best = []
            for e in evicted:
                sims = [float(unit[e] @ unit[k]) for k in chosen]
                target = max(range(len(chosen)), key=lambda i, sims=sims: (sims[i], -i))
                best.append((sims[target], target))
            merge = [s >= threshold for s, _ in best]
            if fraction < 1 and any(merge):
                floor = torch.tensor([s if m else -math.inf for (s, _), m in zip(best, merge)]).quantile(1 - fraction)
                merge = [m and s >= float(floor) for (s, _), m in zip(best, merge)]
            added = [torch.zeros(values.shape[1], dtype=torch.double) for _ in chosen]
            total = [0.0] * len(chosen)
            for e, (s, t), m in zip(evicted, best, merge):
                norm = float(values[e].norm())
                w = max(s, 0.0) * m * norm / (norm + float(values[chosen[t]].norm()) + eps)
                added[t] += w * values[e]
                total[t] += w
            heads.append(torch.stack([(values[k] + a) / (1 + w) if w > 0 else values[k]
                                      for k, a, w in zip(chosen, added, total)]))
        out[layer] = heads
    return out


def think_keys(run, kept, ratio, window):
    """kvpress ThinKPress on the kept keys: per head, the int(D * ratio) channels of least mean(q^2) * mean(k^2)
    (queries: the last ``window``, averaged over the group) zeroed."""
    out = {}
    for layer, r in run.items():
        kv_heads, _, dim = r["key"].shape
        group = r["query"].shape[0] // kv_heads
        heads = []
        for h, chosen in enumerate(kept[layer]):
            keys = r["key"][h, chosen].clone()
            queries = r["query"][h * group : (h + 1) * group, -window:]
            score = [float(queries[:, :, c].pow(2).mean()) * float(keys[:, c].pow(2).mean()) for c in range(dim)]
            for c in sorted(range(dim), key=lambda c, score=score: score[c])[: int(dim * ratio)]:
                keys[:, c] = 0
            heads.append(keys)
        out[layer] = heads
    return out


def kept_entropy_gated_chunkkv(run, capacity, length, low, eps=1e-8):
    """kvpress EntropyGatedChunkKVPress over KeyDiffPress: chunks by mean score (summed over the heads), a
    high-scoring low-entropy chunk reduced to its best ``low`` tokens, the rest of the budget to the best remaining
    tokens. (KeyDiff's signed scores: SnapKV's on a random model are so even that every chunk's entropy is 1 up to
    rounding.)"""
    def entropy(chunk):
        if len(chunk) == 1:
            return 0.0
        shift = min(min(chunk), 0.0)
        p = [(s - shift) / (sum(c - shift for c in chunk) + eps) for s in chunk]
        return min(max(-sum(q * math.log(q + eps) for q in p) / math.log(len(chunk)), 0.0), 1.0)

    def median(values):  # torch.median: the lower of the two middle values
        return sorted(values)[(len(values) - 1) // 2]

    kept = {}
    for layer, r in run.items():
        scores = [keydiff(keys) for keys in r["key"]]
        n = len(scores[0])
        total = [sum(head[j] for head in scores) for j in range(n)]
        bounds = [(a, min(a + length, n)) for a in range(0, n, length)]
        means = [sum(total[a:b]) / (b - a) for a, b in bounds]
        entropies = [entropy(total[a:b]) for a, b in bounds]
        high, flat = median(means), median(entropies)
        chosen, budget = set(), capacity
        for c in sorted(range(len(bounds)), key=lambda c: (-means[c], c)):
            if budget <= 0:
                break
            a, b = bounds[c]
            count = min(b - a, budget, low if means[c] >= high and entropies[c] < flat else b - a)
            chosen |= top(total[a:b], count, a)
            budget -= count
        if budget > 0:
            rest = [j for j in range(n) if j not in chosen]
            chosen |= {rest[i] for i in top([total[j] for j in rest], budget)}
        kept[layer] = [chosen for _ in scores]
    return kept


def kept_lukv(model, run, capacity, curve, sink=4, window=1, epsilon=0.02, future=512):
    """kvpress LUKVPress over ExpectedAttentionPress(epsilon): per head, the curve's keep count at the prompt's ratio,
    filled by the scores with the first ``sink`` and last ``window`` tokens first."""
    from baseline_reference import expected_scores

    kept = {}
    for layer, scores in expected_scores(model, run, 4, future, epsilon).items():
        n = run[layer]["key"].shape[1]
        index = min(98, max(0, round((1 - capacity / n) * 100) - 1))
        keep = [(1 - min(max(float(p), 0.0), 1.0)) * n for p in torch.as_tensor(curve[index, layer]).float()]
        keep = [float(torch.tensor(k, dtype=torch.float32)) for k in keep]
        total = max(len(keep), min(len(keep) * n, round(sum(keep))))
        counts = [math.floor(k) for k in keep]
        fractions = sorted(range(len(keep)), key=lambda h: -(keep[h] - counts[h]))
        for h in fractions[: max(0, total - sum(counts))]:
            counts[h] += 1
        heads = []
        for head, count in zip(scores, counts):
            full = [math.inf] * 4 + head.tolist()  # ExpectedAttention's own sink first, then LU-KV's
            for j in list(range(sink)) + list(range(n - window, n)):
                full[j] = math.inf
            heads.append(top(full, min(max(count, 1), n)))
        kept[layer] = heads
    return kept


def fastkvzip_scores(hidden: torch.Tensor, gate: dict) -> list[list[float]]:
    """kvpress FastKVzipGate per token and KV head, in float64: RMS-normed gate queries (one per group member) and
    key, 1 / (1 + sum over the sink keys of exp(k_base q - k q - b)), averaged over the group."""
    def rms(x, weight):
        return weight * x / math.sqrt(float(x.pow(2).mean()) + 1e-6)

    g = {name: tensor.double() for name, tensor in gate.items()}
    width = g["q_norm.weight"].shape[0]
    heads = g["k_proj.weight"].shape[0] // width
    group = g["q_proj.weight"].shape[0] // (heads * width)
    out = []
    for h in range(heads):
        row = []
        for x in hidden:
            q_all, k_all = g["q_proj.weight"] @ x + g["q_proj.bias"], g["k_proj.weight"] @ x
            k = rms(k_all[h * width : (h + 1) * width], g["k_norm.weight"])
            total = 0.0
            for m in range(group):
                start = (h * group + m) * width
                q = rms(q_all[start : start + width], g["q_norm.weight"])
                logit = float(k @ q) / math.sqrt(width) + float(g["b"][h, 0, m])
                base = [float(kb @ q) / math.sqrt(width) for kb in g["k_base"][h, 0]]
                total += 1 / (1 + sum(math.exp(b - logit) for b in base)) / group
            row.append(total)
        out.append(row)
    return out


def kept_fastkvzip(run, capacity, gates, sink=4, window_ratio=0.02):
    """kvpress FastKVzipPress, layer-wise: the first ``sink`` and last max(1, int(n * ratio)) tokens first, then each
    layer keeps its kv_heads * capacity best (head, token) pairs."""
    kept = {}
    for layer, r in run.items():
        scores = fastkvzip_scores(r["hidden"], gates[layer])
        n = len(scores[0])
        window = max(1, int(n * window_ratio))
        ranked = sorted(((-(math.inf if j < sink or j >= n - window else s), h, j)
                         for h, head in enumerate(scores) for j, s in enumerate(head)))
        heads = [set() for _ in scores]
        for _, h, j in ranked[: len(scores) * capacity]:
            heads[h].add(j)
        kept[layer] = heads
    return kept


def kept_kvzip(model, prompt: torch.Tensor, capacity: int, prompts, chunk: int, scaling: float, sink: int = 4,
               layerwise: bool = False, plus: bool = False) -> dict:
    """KVzip (kvpress ``KVzipPress``): after the prompt, passes "first + suffix + chunk" (later chunks "next + the
    previous chunk's last 8 tokens + suffix + chunk"; the chat prefix, where the prompt starts with it, skipped); a
    token's score is the most softmax weight any pass query of its group gives it among the sinks, the chunk and the
    pass's own keys up to the query (KVzip+: each query's weights over ||hidden||, each key's times ||W_O v|| for
    that query head). Sinks kept; the best ``layers * kv_heads * capacity`` scores of the whole model kept
    (``layerwise``: ``kv_heads * capacity`` per layer)."""
    from baseline_reference import full_run

    tokens, n = prompt[0].tolist(), prompt.shape[1]
    prefix = list(prompts.prefix)
    first = len(prefix) if tokens[: len(prefix)] == prefix else 0
    scores: dict[int, list[list[float]]] = {}
    begin = first
    while begin < n:
        chunk_tokens = tokens[begin : begin + chunk]
        end = begin + len(chunk_tokens)
        ask = list(prompts.first) if begin == first else [*prompts.next, *tokens[max(first, begin - 8) : begin]]
        passed = [*ask, *prompts.suffix, *chunk_tokens]
        run = full_run(model, torch.tensor([tokens + passed]))
        for layer, r in run.items():
            kv_heads, q_heads = r["key"].shape[0], r["query"].shape[0]
            group = q_heads // kv_heads
            out = model.model.layers[layer].self_attn.o_proj.weight.detach().double()
            dim = r["key"].shape[-1]
            scores.setdefault(layer, [[0.0] * n for _ in range(kv_heads)])
            for q_head in range(q_heads):
                kv = q_head // group
                for t in range(len(passed)):
                    row = n + t
                    columns = [*range(min(sink, begin)), *range(begin, end), *range(n, row + 1)]
                    logits = torch.tensor([float(r["query"][q_head][row] @ r["key"][kv][c]) * scaling for c in columns],
                                          dtype=torch.double)
                    weights = logits.softmax(dim=0).tolist()
                    for offset, c in enumerate(columns):
                        if not begin <= c < end:
                            continue
                        w = weights[offset]
                        if plus:
                            w /= float(r["hidden"][row].norm())
                            w *= float((out[:, q_head * dim : (q_head + 1) * dim] @ r["value"][kv][c]).norm())
                        scores[layer][kv][c] = max(scores[layer][kv][c], w)
        begin = end
    for heads in scores.values():
        for head in heads:
            head[: min(sink, n)] = [TOP] * min(sink, n)
    kept = {layer: [set() for _ in heads] for layer, heads in scores.items()}
    layers = sorted(scores)
    pools = [layers] if not layerwise else [[layer] for layer in layers]
    for pool in pools:
        entries = [(-scores[layer][head][pos], layer, head, pos) for layer in pool
                   for head in range(len(scores[layer])) for pos in range(n)]
        count = len(pool) * len(scores[pool[0]]) * min(capacity, n)
        for _, layer, head, pos in sorted(entries)[:count]:
            kept[layer][head].add(pos)
    return kept


QUEST: dict = {}  # the reference Quest's settings while it runs: page_size, capacity, dense_layers


def _quest_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Quest's decode step, one query head at a time in float64: pages of ``page_size`` keys from the first, each
    scored by sum_d max(q_d * k_d) over the page's keys (the bound of its min/max box), the best min(max(3, capacity //
    page_size), pages) read (ties to the earlier page); layers below ``dense_layers`` and multi-token steps read all."""
    q_heads, q_len, k_len = query.shape[1], query.shape[2], key.shape[2]
    group = q_heads // key.shape[1]
    page = QUEST["page_size"]
    out = torch.zeros(1, q_heads, q_len, value.shape[-1], dtype=torch.double)
    for head in range(q_heads):
        q, k, v = query[0, head].double(), key[0, head // group].double(), value[0, head // group].double()
        for i in range(q_len):
            visible = list(range(k_len - q_len + i + 1))
            if q_len == 1 and module.layer_idx >= QUEST["dense_layers"]:
                starts = list(range(0, k_len, page))
                bounds = [sum(max(float(q[i, d] * k[j, d]) for j in range(s, min(s + page, k_len)))
                              for d in range(k.shape[1])) for s in starts]
                count = min(max(3, QUEST["capacity"] // page), len(starts))
                best = sorted(range(len(starts)), key=lambda p: (-bounds[p], p))[:count]
                visible = [j for p in best for j in range(starts[p], min(starts[p] + page, k_len))]
            logits = torch.stack([q[i] @ k[j] for j in visible]) * scaling
            out[0, head, i] = logits.softmax(dim=0) @ v[visible]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@torch.no_grad()
def quest_generate(model, prompt: torch.Tensor, new: int, page_size: int, capacity: int, dense_layers: int):
    """Greedy decoding with a full cache and Quest's reading rule (the reference attention above): the tokens and
    each step's logits."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("reference_quest", _quest_attention)
    AttentionMaskInterface.register("reference_quest", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    QUEST.update(page_size=page_size, capacity=capacity, dense_layers=dense_layers)
    original = model.config._attn_implementation
    model.config._attn_implementation = "reference_quest"
    cache, tokens, logits = DynamicCache(config=model.config), [], []
    try:
        out = model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True)
        for _ in range(new):
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), **cache_kwargs(model, cache), use_cache=True)
    finally:
        model.config._attn_implementation = original
        QUEST.clear()
    return tokens, torch.stack(logits)


RKV: dict = {}  # the reference R-KV's settings and state while it runs


def rkv_scores(queries: torch.Tensor, keys: torch.Tensor, window: int, kernel: int, lam: float, threshold: float,
               scaling: float) -> list[float]:
    """R-KV's score of one KV head's held keys ``[L, D]`` (text order) from the window's queries ``[G, w, D]`` (the
    query heads of its group), written from the reference's ``update_kv`` and ``cal_similarity`` in float64: the
    last ``window`` keys are the window, the others get a score."""
    keys, queries = keys.double(), queries.double()
    held, prefix = keys.shape[0], keys.shape[0] - window
    logits = torch.stack([queries[g] @ keys.T * scaling for g in range(queries.shape[0])]).amax(dim=0)  # [w, L]
    importance = logits[:, :prefix].softmax(dim=-1).mean(dim=0)
    pooled = [max(importance[max(0, i - kernel // 2): i + kernel // 2 + 1]) for i in range(prefix)]
    normed = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    cosine = normed @ normed.T
    for i in range(held):
        cosine[i, i] = 0.0
        similar = [j for j in range(held) if cosine[i, j] > threshold]
        cosine[i, similar[-1] if similar else 0] = 0.0
    redundancy = cosine.mean(dim=0).softmax(dim=0)
    return [float(pooled[i]) * lam - float(redundancy[i]) * (1 - lam) for i in range(prefix)]


def _rkv_keep(layer: int, queries: torch.Tensor, keys: torch.Tensor) -> None:
    """Compress every KV head of ``layer`` to R-KV's budget: its window and the best others."""
    s = RKV
    group = queries.shape[0] // keys.shape[0]
    for head, held in enumerate(s["held"][layer]):
        scores = rkv_scores(queries[head * group:(head + 1) * group, -s["window"]:], keys[head, held], s["window"],
                            s["kernel"], s["lam"], s["threshold"], s["scaling"])
        best = top(scores, s["budget"] - s["window"])
        s["held"][layer][head] = sorted(held[i] for i in best) + held[len(held) - s["window"]:]


def _rkv_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Full-cache attention in float64 over the keys R-KV holds, each layer compressed after its attention as R-KV
    compresses (the prompt once it reaches the budget; then every step whose token's position is a multiple of the
    interval)."""
    s, layer = RKV, module.layer_idx
    q_len, k_len = query.shape[2], key.shape[2]
    group = query.shape[1] // key.shape[1]
    queries = s.setdefault("queries", {})
    queries[layer] = torch.cat([queries[layer], query[0]], dim=1) if layer in queries else query[0]
    held = s["held"].setdefault(layer, [list(range(k_len - q_len)) for _ in range(key.shape[1])])
    for heads in held:
        heads.extend(range(k_len - q_len, k_len))
    out = torch.zeros(1, query.shape[1], q_len, value.shape[-1], dtype=torch.double)
    for head in range(query.shape[1]):
        visible = held[head // group]
        for i in range(q_len):
            seen = [j for j in visible if j <= k_len - q_len + i]
            logits = query[0, head, i].double() @ key[0, head // group, seen].double().T * scaling
            out[0, head, i] = logits.softmax(dim=0) @ value[0, head // group, seen].double()
    position = k_len - 1
    if len(held[0]) >= s["budget"] and (q_len > 1 or position % s["interval"] == 0):
        _rkv_keep(layer, queries[layer], key[0])
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@torch.no_grad()
def rkv_generate(model, prompt: torch.Tensor, new: int, capacity: int, window: int, interval: int, kernel: int = 7,
                 lam: float = 0.07, threshold: float = 0.5):
    """Greedy decoding with a full cache read as R-KV holds it (the reference attention above): the tokens, each
    step's logits and, per layer, the positions each KV head holds at the end."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("reference_rkv", _rkv_attention)
    AttentionMaskInterface.register("reference_rkv", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    RKV.update(budget=capacity - interval, window=window, interval=interval, kernel=kernel, lam=lam,
               threshold=threshold, scaling=head_dim ** -0.5, held={})
    original = config._attn_implementation
    config._attn_implementation = "reference_rkv"
    cache, tokens, logits = DynamicCache(config=config), [], []
    try:
        out = model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True)
        for step in range(new):
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
            if step < new - 1:
                out = model(input_ids=torch.tensor([[tokens[-1]]]), **cache_kwargs(model, cache), use_cache=True)
        held = [RKV["held"][layer] for layer in sorted(RKV["held"])]
    finally:
        config._attn_implementation = original
        RKV.clear()
    return tokens, torch.stack(logits), held
