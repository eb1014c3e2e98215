"""CaM: the tokens each layer and KV head holds after prefill and after every decode step, the values it holds (the
merged ones included) and the logits, against a plain float64 replay written from kvpress' ``CAMPress``: KNorm scores
averaged over the KV heads, the attention of every decode step summed per KV head (the mean over its query heads), a
compression once ``interval`` steps have passed since the last one while more than ``capacity - interval`` tokens are
held (kvpress' step counter), each evicted value added, ``/ |window|``, to the ``merge_budget`` kept tokens after it
with a Bernoulli draw of ``clamp(A_i / mean(A over the window), 0, 1)`` from the generator the method's seed, the layer
and the step's position seed (the draws of both sides are the same; one closer than 1e-5 to its probability is
reported, not decided by the last bit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from baseline_reference import _probabilities, full_run, replay_decoding
from conftest import VOCAB, random_prompt, tiny_model
from masked_reference import _RECORD, module_scaling

import evalkit.compression as ec
from evalkit.core.errors import ConfigError

TOLERANCE = 1e-5
ROOT = Path(__file__).resolve().parents[1]
SCORE_TIE = 1e-6
# (capacity, settings, prompt length): TOVA ranking a prompt within the target (the first compression comes late),
# its tokens generated; KNorm with forced tokens ranking a prompt compressed at prefill, fed distinct tokens (in layer 0
# a repeated token's key has the same norm at every position: a tie only the last bit would break)
SETTINGS = {
    "tova_short_prompt": (56, dict(interval=8, merge_budget=4, seed=3, scorer="tova"), 40),
    "knorm_long_prompt_forced": (40, dict(interval=8, merge_budget=16, sink=2, window=3, seed=7), 60),
}


def peaked_model():
    """The tiny llama with larger weights: uneven attention, so that merge probabilities fall inside (0, 1)."""
    return tiny_model("llama", initializer_range=0.2)


def ranked(order: list[int], score: dict[int, float], keep: int, sink: int, window: int) -> set[int]:
    """The ``keep`` best of the held positions ``order`` (text order), the first ``sink`` and last ``window`` always."""
    if keep >= len(order):
        return set(order)
    forced = set(order[:sink]) | set(order[len(order) - window:])
    rest = sorted((j for j in order if j not in forced), key=lambda j: (-score[j], j))
    count = keep - len(forced)
    assert abs(score[rest[count - 1]] - score[rest[count]]) > SCORE_TIE, "two scores tie at the cut"
    return forced | set(rest[:count])


def scored(policy, query: torch.Tensor, keys: torch.Tensor, order: list[int], scaling) -> dict[int, float]:
    """The scorer's scores of the held positions ``order``, averaged over the KV heads: KNorm's ``-||k||``, or
    TOVA's attention of the last query ``query`` ``[Hq, D]`` (the mean over every query head); keys ``[Hkv, T, D]``."""
    kv_heads = keys.shape[0]
    if isinstance(policy.scorer, ec.TOVA):
        group = query.shape[0] // kv_heads
        mean = torch.tensor([_probabilities(query[qh], keys[qh // group], order, scaling)
                             for qh in range(query.shape[0])]).mean(dim=0).tolist()
        return dict(zip(order, mean))
    return {j: sum(-float(keys[h, j].double().norm()) for h in range(kv_heads)) / kv_heads for j in order}


def forced(policy) -> tuple[int, int]:
    return (0, 0) if isinstance(policy.scorer, ec.TOVA) else (policy.scorer.sink, policy.scorer.window)


def draws(probabilities: torch.Tensor, seed: int, layer: int, position: int) -> torch.Tensor:
    """The Bernoulli draws of a compression (``[Hkv, M]``), from the generator of the method's definition."""
    def drawn(p):
        generator = torch.Generator().manual_seed((position + 1_000_003 * (layer + 1_000_003 * seed)) % 2 ** 32)
        return torch.bernoulli(p.float().clamp(0, 1), generator=generator)

    out = drawn(probabilities)
    assert torch.equal(drawn(probabilities - TOLERANCE), drawn(probabilities + TOLERANCE)), "a draw near its p"
    return out


class Replay:
    """The definition's state of one sequence: per layer the held positions (every head the same), the attention
    sums per head, the float64 values, the steps since the last compression, and the order a cache holds the
    positions in: text order (CaM's official code, evalkit); under ``score_order`` the prefill's kept positions best
    score first, then each generated one, as kvpress' cache holds them after its ``ScorerPress`` prefill. A merge
    window is the ``merge_budget`` kept positions after the evicted one in that order, and the draws go in it."""

    def __init__(self, policy, run: dict, n: int, scaling, score_order: bool = False):
        self.policy, self.target, self.counted, self.scaling = policy, policy.capacity - policy.interval, {}, scaling
        self.held, self.sums, self.values, self.merges, self.order = {}, {}, {}, [], {}
        for layer, r in run.items():
            score = scored(policy, r["query"][:, -1], r["key"], list(range(n)), scaling)
            kept = ranked(list(range(n)), score, self.target, *forced(policy))
            self.order[layer] = sorted(kept, key=lambda j: (-score[j], j) if score_order else j)
            self.held[layer] = [set(kept) for _ in range(r["key"].shape[0])]
            self.sums[layer] = [{} for _ in range(r["key"].shape[0])]
            self.values[layer] = r["value"].clone()
            self.counted[layer] = 0

    def step(self, layer, per_head, query, keys, position):
        values = _RECORD["values"][layer][0]  # the replay's cache: [Hkv, position + 1, D], what the model reads
        self.values[layer] = torch.cat([self.values[layer], values[:, position:].double()], dim=1)
        self.order[layer].append(position)
        group = query.shape[0] // keys.shape[0]
        for h, heads in enumerate(per_head):
            order = sorted(heads)
            mean = torch.tensor([_probabilities(query[h * group + g], keys[h], order, self.scaling)
                                 for g in range(group)]).mean(dim=0).tolist()
            for j, p in zip(order, mean):
                self.sums[layer][h][j] = self.sums[layer][h].get(j, 0.0) + p
        self.counted[layer] += 1
        if self.counted[layer] >= self.policy.interval and len(per_head[0]) > self.target:
            self.compress(layer, per_head, query, keys, position, values)
            self.counted[layer] = 0

    def compress(self, layer, per_head, query, keys, position, cache_values):
        policy, order = self.policy, sorted(per_head[0])
        assert all(heads == per_head[0] for heads in per_head) and sorted(self.order[layer]) == order
        score = scored(policy, query, keys, order, self.scaling)
        kept = ranked(order, score, self.target, *forced(policy))
        cached = self.order[layer]  # text order, or kvpress' after its prefill
        evicted = [j for j in cached if j not in kept]
        windows = [[t for t in cached[cached.index(i) + 1:] if t in kept][: policy.merge_budget] for i in evicted]
        probabilities = torch.zeros(len(per_head), len(evicted), dtype=torch.float64)
        for h, sums in enumerate(self.sums[layer]):
            for m, (i, window) in enumerate(zip(evicted, windows)):
                mean = sum(sums[t] for t in window) / max(len(window), 1)
                ratio = sums[i] / mean if mean else (0.0 if sums[i] == 0 else 1.0)
                probabilities[h, m] = min(max(ratio, 0.0), 1.0)
        drawn = draws(probabilities, policy.seed, layer, position)
        before = self.values[layer].clone()
        for h in range(len(per_head)):
            for m, (i, window) in enumerate(zip(evicted, windows)):
                for t in window if drawn[h, m] else ():
                    self.values[layer][h, t] += before[h, i] / len(window)
            per_head[h].difference_update(evicted)
            for i in evicted:
                del self.sums[layer][h][i]
        self.order[layer] = [j for j in cached if j in kept]
        cache_values.copy_(self.values[layer].to(cache_values.dtype))
        self.merges.append((layer, position, int(drawn.sum()), int(((probabilities > 0) & (probabilities < 1)).sum())))


@torch.no_grad()
def simulate(model, policy, prompt: torch.Tensor, tokens: list[int], score_order: bool = False):
    """The replay: its logits, after each step the positions held per layer and head and the float64 values."""
    run, scaling = full_run(model, prompt), module_scaling(model)
    replay = Replay(policy, run, prompt.shape[1], scaling, score_order)
    values = []

    def evict(layer, per_head, query, keys, position, steps):
        replay.step(layer, per_head, query, keys, position)
        if layer == len(replay.held) - 1:
            values.append({index: v.clone() for index, v in replay.values.items()})

    prefill = {layer: [set(h) for h in per_head] for layer, per_head in replay.held.items()}
    logits, history = replay_decoding(model, prompt, tokens, replay.held, evict)
    return prefill, logits, history, values, replay.merges


def held_now(session) -> dict[int, list[set[int]]]:
    return {index: [set(layer.heads.positions[0, h][layer.heads.valid[0, h]].tolist())
                    for h in range(layer.heads.valid.shape[1])] for index, layer in enumerate(session.cache.layers)}


def value_error(session, values: dict[int, torch.Tensor]) -> float:
    """The largest difference between the values the cache holds and the replay's, over every held slot."""
    worst = 0.0
    for index, layer in enumerate(session.cache.layers):
        heads = layer.heads
        for h in range(heads.valid.shape[1]):
            slots = heads.valid[0, h].nonzero().flatten()
            held = layer.values[0, h, slots].double()
            worst = max(worst, float((held - values[index][h, heads.positions[0, h, slots]]).abs().max()))
    return worst


def run_both(settings: str, seed: int | None = None, steps: int = 30, score_order: bool = False):
    """The model, the method, the prompt, the tokens fed (generated, or distinct ones for KNorm) and the replay."""
    capacity, config, n = SETTINGS[settings]
    llama = peaked_model()
    policy = ec.CaM.from_config(capacity, **config)
    if isinstance(policy.scorer, ec.TOVA):
        prompt = random_prompt(n, seed=4)
        tokens = ec.generate(llama, prompt, policy, max_new_tokens=steps).sequences[0, n:].tolist()
    else:
        ids = 3 + torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(4))[: n + steps]
        prompt, tokens = ids[None, :n], ids[n:].tolist()
    reference_policy = policy if seed is None else ec.CaM.from_config(capacity, **{**config, "seed": seed})
    reference = simulate(llama, reference_policy, prompt, tokens[:-1], score_order)
    return llama, policy, prompt, tokens, reference


@pytest.mark.parametrize("settings", sorted(SETTINGS))
def test_cam_holds_and_merges_what_its_definition_does_after_prefill_and_every_step(settings):
    llama, policy, prompt, tokens, (prefill, reference_logits, history, values, merges) = run_both(settings)
    n, target = prompt.shape[1], policy.capacity - policy.interval
    session = ec.CompressionSession(llama, policy)
    first = session.prefill(prompt)
    assert held_now(session) == prefill
    logits, originals = [], [layer.values[0].clone() for layer in session.cache.layers]
    for step, token in enumerate(tokens[:-1]):
        logits.append(session.step(torch.tensor([[token]]))[0, -1])
        assert held_now(session) == history[step], f"step {step}"
        assert value_error(session, values[step]) < TOLERANCE, f"step {step}"
        for layer in session.cache.layers:  # the real tensors: capacity slots, never more held
            assert layer.keys.shape[-2] == policy.capacity
            assert int(layer.heads.valid[0].sum(dim=-1).max()) <= policy.capacity
    torch.testing.assert_close(torch.stack(logits), reference_logits, atol=2e-4, rtol=1e-4)
    assert torch.stack(logits).argmax(dim=-1).tolist() == reference_logits.argmax(dim=-1).tolist()
    if isinstance(policy.scorer, ec.TOVA):  # the generated tokens are the definition's
        assert [first.argmax(-1).item(), *reference_logits.argmax(dim=-1).tolist()] == tokens
    # It evicted and merged: prompt tokens left, compressions brought the cache to its target, some draws fell
    # inside (0, 1) and some merged, and prompt values the cache still holds are no longer the model's own.
    assert len(history[-1][0][0] & set(range(n))) < min(n, target)
    assert any(len(per_head[0]) == target for snapshot in history for per_head in snapshot.values())
    assert sum(merged for *_, merged, _ in merges) > 0 and sum(uncertain for *_, uncertain in merges) > 0
    changed = 0
    for layer, original in zip(session.cache.layers, originals):
        prompt_slots = layer.heads.valid[0] & (layer.heads.positions[0] < n)
        changed += int(((layer.values[0] - original).abs().amax(dim=-1) > 1e-3)[prompt_slots].sum())
    assert changed > 0


def test_the_replay_detects_other_draws():
    """The check can fail: the replay drawing from another seed holds other values."""
    llama, policy, prompt, tokens, (_, _, _, values, _) = run_both("knorm_long_prompt_forced", seed=4)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    worst = 0.0
    for step, token in enumerate(tokens[:-1]):
        session.step(torch.tensor([[token]]))
        worst = max(worst, value_error(session, values[step]))
    assert worst > 1e-3


def test_merges_go_to_text_neighbours_not_to_kvpress_score_order():
    """After a prefill that compressed the prompt, kvpress' cache holds the kept prompt in score order (its
    ``ScorerPress`` gathers in ``topk`` order) and ``CAMPress`` merges into the tokens after the evicted one in the
    cache: score neighbours. evalkit merges into text neighbours, as CaM's official code does (a documented
    difference; ``benchmarks/parity_cam_prefill.py`` undoes it in kvpress: identical). A replay in kvpress' order holds
    other values from the first compression on, so the exactness test above tells the two apart."""
    llama, policy, prompt, tokens, (_, _, history, values, merges) = run_both("knorm_long_prompt_forced",
                                                                              score_order=True)
    session = ec.CompressionSession(llama, policy)
    session.prefill(prompt)
    first = min(step for step, snapshot in enumerate(history) if len(snapshot[0][0]) == policy.capacity - policy.interval)
    gaps = []
    for step, token in enumerate(tokens[:-1]):
        session.step(torch.tensor([[token]]))
        if step < first:  # no compression yet: the order made no difference
            assert held_now(session) == history[step] and value_error(session, values[step]) < TOLERANCE
        elif held_now(session)[0] == history[step][0]:  # layer 0's keys are the tokens' own: the same held positions
            gaps.append(value_error(session, values[step]))
    assert gaps and max(gaps) > 1e-3 and sum(merged for *_, merged, _ in merges) > 0


def test_cam_gives_a_batch_and_the_engine_what_each_prompt_gets_alone():
    """Each row draws from its own generator. (Ranked by TOVA: KNorm's layer-0 scores of a repeated token tie up to
    the last bit of its keys, which differs between batch shapes.)"""
    from test_compression import assert_batch_equals_alone, assert_engine_equals_alone

    llama, policy = peaked_model(), ec.CaM.from_config(30, interval=6, merge_budget=3, seed=2, scorer="tova")
    assert_batch_equals_alone(llama, policy, new_tokens=30)
    assert_engine_equals_alone(llama, policy, new_tokens=30)


@pytest.mark.parametrize("settings, message", [
    (dict(capacity=8, interval=8), r"CaM.capacity must be > interval \(8\)"),
    (dict(capacity=40, interval=8, merge_budget=0), "merge_budget must be an integer >= 1"),
    (dict(capacity=40, interval=8, scorer="adakv"), "CaM.scorer cannot be adakv: it allocates budgets itself"),
    (dict(capacity=40, interval=8, scorer="observed_attention"), "sums the attention of every query"),
    (dict(capacity=40, interval=8, scorer={"name": "snapkv", "window": 16}), r"reads 16 queries, more than the 8"),
    (dict(capacity=40, interval=8, window=32), r"must be > sink \+ window \(32\), got 32"),  # the 32 kept
])
def test_cam_refuses_settings_it_cannot_run(settings, message):
    capacity = settings.pop("capacity")
    with pytest.raises(ValueError, match=message) as caught:
        ec.CaM.from_config(capacity, **settings)
    assert "\n" not in str(caught.value)


def test_cam_refuses_a_quantized_cache_in_one_line():
    from test_harness import composed

    from evalkit.run import validate

    with pytest.raises(ConfigError, match="kv_bits < 16 does not combine with method=cam") as caught:
        validate(composed("method=cam", "+budget=tokens_4096", "kv_bits=4", "model=llama31_8b_instruct"))
    assert "\n" not in str(caught.value)
    policy = ec.CaM.from_config(40, interval=8)
    policy.kv_format = None  # 16 bits: nothing to refuse
    assert policy.kv_format is None


@pytest.mark.slow
def test_the_cam_paritys_evalkit_side_merges_and_evicts(tmp_path):
    """The evalkit worker of `parity_cam.py` on its saved model and prompt: every layer and head holds the target
    after each compression, the same positions for every head, and some held values were merged."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from parity_cam import CASES, STEPS
    from parity_model import save_model

    save_model(tmp_path, 600)
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parity_cam.py"), "--worker", "evalkit",
                             "--model", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for case, (target, interval, _, length) in CASES.items():
        assert len(out[case]["tokens"]) == STEPS
        for heads in out[case]["heads"]:
            kept = heads[0]["kept"]
            assert len({tuple(head["kept"]) for head in heads}) == 1 and target < len(kept) <= target + interval
            assert sum(position < length for position in kept) < length  # prompt tokens were evicted
        assert out[case]["merged"] > 0, case


@pytest.mark.slow
def test_kvpress_after_a_knorm_prefill_agrees_once_its_score_order_is_undone():
    """`parity_cam_prefill.py` on its random GQA Llama, kvpress 0.5.5 in its environment (benchmarks/kvpress_venv.sh,
    EVALKIT_KVPRESS_VENV or /tmp/kvpress-venv): as kvpress does it, its merges after the KNorm prefill go elsewhere
    (values apart); with its prefill's score order undone, every head holds evalkit's positions and values."""
    import os
    import re

    venv = Path(os.environ.get("EVALKIT_KVPRESS_VENV", "/tmp/kvpress-venv"))
    python = venv / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", "import kvpress"], capture_output=True).returncode:
        pytest.skip(f"needs kvpress 0.5.5 in {venv} (bash benchmarks/kvpress_venv.sh; or point EVALKIT_KVPRESS_VENV "
                    "at one)")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parity_cam_prefill.py"), "--venv", str(venv)],
                            capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {}
    for line in result.stdout.splitlines():
        found = re.match(r"(score|text) order .*?(\d+)/(\d+)\s+(\d+)\s+(\S+)\s+(\d+), (\d+)\s+(\d+)/(\d+)$", line)
        if found:
            rows[found.group(1)] = [float(x) for x in found.groups()[1:]]
    same, heads, differ, worst, merged_theirs, merged_ours, agree, steps = rows["text"]
    assert same == heads == 8 and differ == 0 and worst < 1e-5 and merged_theirs == merged_ours > 0 and agree == steps
    assert rows["score"][3] > 1e-3  # as kvpress does it: the same positions, other merged values
