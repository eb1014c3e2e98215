"""kvpress 0.5.5's ``KVComposePress`` and ``CompressionRatioDecodingPress`` beside evalkit's ``kvcompose`` and
``compression_ratio_decoding``: the same tiny Llama (tests/conftest.py's, saved once and loaded by both sides) and
prompt of distinct tokens; do they keep the same tokens per layer and KV head?

    .venv/bin/python benchmarks/parity_presses.py [--venv /tmp/kvpress-venv] [--write tests/fixtures/kvpress_presses.json]

* KVCompose: kvpress' press around ``model.model`` over the prompt (as its pipeline runs it: the pass repeats the
  context); kept tokens are those its cache holds (structured) or its ``masked_key_indices`` leave (unstructured).
* CompressionRatioDecoding: KNorm ranks (order- and query-free, so that the press' schedule and sizes are what is
  compared); the prompt, then ``TOKENS`` fed one at a time at their positions; kept tokens after the last step.
  ``prefill`` cases compress the prompt first (kvpress ``PrefillDecodingPress(KnormPress, ...)``).

Each side maps its cache's keys to the nearest key of a full-cache run of the whole sequence. ``--write`` stores
kvpress' kept sets with the prompt and tokens as the fixture tests/test_kvpress_presses.py checks evalkit against.
"""

from __future__ import annotations

from parity_runner import Parity, Side, from_tests, kvpress_environment, run_parity, venv_option, write_fixture

N, NEW = 60, 30
KVCOMPOSE = {  # case: (kvpress' settings, evalkit's), at compression_ratio 0.5 (capacity N // 2)
    "default": ({}, {}),
    "unstructured mean/max": ({"structured": False, "agg_task": "mean", "agg_group": "max"},
                              {"structured": False, "agg_task": "mean", "agg_group": "max"}),
    "agg_head max, bound 3, no mean": ({"agg_head": "max", "keep_token_lower_bound": 3, "add_mean_across_heads": False},
                                       {"agg_head": "max", "keep_token_lower_bound": 3, "add_mean_across_heads": False}),
    "add_v_norm": ({"add_v_norm": True}, {"add_v_norm": True}),
}
DECODING = {  # case: (ratio, interval, prefill's ratio or None)
    "ratio 0.5 every 8": (0.5, 8, None),
    "ratio 0.25 every 5": (0.25, 5, None),
    "ratio 0.5 every 8, prefill 0.25": (0.5, 8, 0.25),
}


def sequence():
    """The prompt ``[1, N]`` and the tokens fed after it, all distinct (a repeated token's key has the same norm)."""
    import torch

    ids = 3 + torch.randperm(94, generator=torch.Generator().manual_seed(0))[: N + NEW]
    return ids[None, :N], ids[N:].tolist()


def held(full, rows, tolerance: float = 1e-3, what: str = "key") -> list[list[int]]:
    """Per KV head, the positions of ``full`` ``[H, T, D]`` nearest the cached ``rows`` (per head ``[m, D]``: keys,
    or ``what`` they are) within ``tolerance``."""
    import torch

    out = []
    for head in range(len(rows)):
        distances = torch.cdist(rows[head].double(), full[head].double())
        assert bool((distances.min(dim=1).values < tolerance).all()), f"a cached {what} matches no {what} of the sequence"
        out.append(sorted(distances.argmin(dim=1).tolist()))
    return out


def full_keys(model, ids):
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return [layer.keys[0] for layer in cache.layers]


def run_kvpress(folder: str) -> dict:
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    prompt, tokens = sequence()
    full = full_keys(model, torch.cat([prompt, torch.tensor([tokens])], dim=1))
    out = {"kvcompose": {}, "compression_ratio_decoding": {}}
    for case, (settings, _) in KVCOMPOSE.items():
        press, cache = kvpress.KVComposePress(compression_ratio=0.5, **settings), DynamicCache()
        try:
            with torch.no_grad(), press(model):
                model.model(input_ids=prompt, past_key_values=cache)
        except Exception as error:  # noqa: BLE001 - kvpress' own failure is the result
            out["kvcompose"][case] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            continue
        kept = []
        for index, layer in enumerate(cache.layers):
            masked = getattr(model.model.layers[index].self_attn, "masked_key_indices", None)
            heads = held(full[index], list(layer.keys[0, :, :N]))  # unstructured: the pass' copy stays after
            if masked is not None:
                heads = [sorted(set(range(N)) - set(masked[2][masked[1] == h].tolist())) for h in range(len(heads))]
                model.model.layers[index].self_attn.masked_key_indices = None
            kept.append(heads)
        out["kvcompose"][case] = kept
    for case, (ratio, interval, prefill) in DECODING.items():
        scores, scorers = {}, (kvpress.KnormPress(), kvpress.KnormPress(prefill or 0.0))
        for scorer in scorers:
            scorer.score = recording(scorer.score, scores)
        decoding = kvpress.CompressionRatioDecodingPress(scorers[0], target_compression_ratio=ratio,
                                                         compression_interval=interval)
        press = decoding if prefill is None else kvpress.PrefillDecodingPress(scorers[1], decoding)
        cache = DynamicCache()
        with torch.no_grad():
            with press(model) if prefill is not None else torch.no_grad():  # the prompt: prefill's press only
                model(input_ids=prompt, past_key_values=cache, use_cache=True)
            rows = [tracked(torch.arange(N).expand(layer.keys.shape[1], -1), scores.pop(i, None), layer.keys.shape[2])
                    for i, layer in enumerate(cache.layers)]
            with press(model):
                for step, token in enumerate(tokens):
                    model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                          position_ids=torch.tensor([[N + step]]))
                    rows = [tracked(torch.cat([r, torch.full((r.shape[0], 1), N + step)], dim=1), scores.pop(i, None),
                                    layer.keys.shape[2]) for i, (r, layer) in enumerate(zip(rows, cache.layers))]
        out["compression_ratio_decoding"][case] = [[sorted(head.tolist()) for head in r] for r in rows]
    return out


def evalkit_method(name: str, case: str):
    import evalkit.compression as ec

    if name == "kvcompose":
        return ec.KVCompose(capacity=N // 2, **KVCOMPOSE[case][1])
    ratio, interval, prefill = DECODING[case]
    capacity = N if prefill is None else int(N * (1 - prefill))
    return ec.CompressionRatioDecoding(capacity=capacity, ratio=ratio, interval=interval)


def recording(score, scores: dict):
    """kvpress' ``score``, each layer's last scores kept in ``scores``."""

    def record(module, *args):
        scores[module.layer_idx] = score(module, *args)
        return scores[module.layer_idx]

    return record


def tracked(rows, scores, length: int):
    """The text positions ``rows`` ``[H, m]`` a kvpress layer's cache holds, after a compression that ranked by
    ``scores`` (None: none) left ``length`` of them, in the order its ``topk`` left them."""
    if scores is None or length == rows.shape[1]:
        return rows
    return rows.gather(1, scores[0].topk(length, dim=-1).indices)


def run_evalkit(model) -> dict:
    import torch

    import evalkit.compression as ec

    prompt, tokens = sequence()
    out = {}
    for name, cases in (("kvcompose", KVCOMPOSE), ("compression_ratio_decoding", DECODING)):
        out[name] = {}
        for case in cases:
            session = ec.CompressionSession(model, evalkit_method(name, case))
            session.prefill(prompt)
            for token in tokens if name != "kvcompose" else ():
                session.step(torch.tensor([[token]]))
            heads = [layer.heads for layer in session.cache.layers]
            out[name][case] = [sorted(p[v].tolist()) for h in heads for p, v in zip(h.positions[0], h.valid[0])]
            out[name][case] = [out[name][case][i * len(heads[0].valid[0]): (i + 1) * len(heads[0].valid[0])]
                               for i in range(len(heads))]
    return out


def kept_cells(theirs, ours) -> str:
    """A row's cells after its label: the heads whose kept sets agree and the positions that differ, or kvpress'
    failure (``theirs`` its message)."""
    if isinstance(theirs, str):
        return f"kvpress fails: {theirs}"
    pairs = [(set(a), set(b)) for la, lb in zip(theirs, ours) for a, b in zip(la, lb)]
    same, differ = sum(a == b for a, b in pairs), sum(len(a ^ b) for a, b in pairs)
    return f"{same}/{len(pairs):<13} {differ}"


def fixture_options(parser, write: str = "the fixture to write kvpress' kept sets to") -> None:
    """The arguments of a parity that records kvpress' side as a test's fixture (this script's, parity_finch.py's,
    parity_expected_attention_stats.py's): kvpress' environment, the fixture, and a worker's model folder."""
    venv_option(parser)
    parser.add_argument("--write", help=write)
    parser.add_argument("--model")


SIDES = {"kvpress": Side(lambda args: run_kvpress(args.model), reference=True)}


def compare(parity: Parity, args) -> None:
    model = from_tests("conftest").tiny_model()
    model.save_pretrained(parity.folder)
    theirs = parity.run("kvpress", "--model", str(parity.folder))
    ours = run_evalkit(model)
    print(f"{'method':<28} {'case':<34} heads agreeing  positions differing")
    for name, cases in theirs.items():
        for case, kept in cases.items():
            print(f"{name:<28} {case:<34} {kept_cells(kept, ours[name][case])}")
    if args.write:
        prompt, tokens = sequence()
        write_fixture(args.write, {"prompt": prompt[0].tolist(), "tokens": tokens, "kept": theirs})


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=fixture_options, environment=kvpress_environment)
