"""kvpress' DMSPress with ``decoding=True`` beside evalkit's ``threshold`` with ``decoding``: the same random GQA Llama,
prompt and KVzap surrogates; are the positions each layer and KV head holds after the decode steps the same?

    python benchmarks/parity_dms_decoding.py [--length 600] [--steps 64] [--venv .kvpress-venv]

The model is parity_model.py's (4 layers, 8 query and 2 KV heads of 32, fp32, seeded); the surrogates are KVzap MLPs
(hidden 24, random) written by tests/learned_files.py in the publishers' format, read by kvpress' ``KVzapModel`` and by
evalkit from the same folder. kvpress 0.5.5 runs in its own environment (made on demand as in bench_vs_kvpress.py;
where it cannot be made, one line and exit 0) as its pipeline does: the prompt inside ``press(model)``, then greedy
steps of one token inside ``press(model)`` again; the positions it holds are those its ``masked_key_indices`` leave
(it masks, never removes). evalkit runs ``CompressionSession.prefill`` and ``step`` and reads ``ec.kept_positions``.
Per case a line prints the heads (over all layers) whose held positions agree, the positions that differ, the tokens
held on each side, the generated tokens each side evicted (per layer and head, summed) and whether the greedy tokens
are the same.
"""

from __future__ import annotations

import shutil

from parity_model import agreement, load_saved, model_options, save_model
from parity_runner import Parity, Side, from_tests, kvpress_environment, run_parity

# case: (threshold, sliding_window_size)
CASES = {"threshold 0 window 128": (0.0, 128), "threshold 0 window 16": (0.0, 16),
         "threshold 0.5 window 32": (0.5, 32), "threshold -0.5 window 0": (-0.5, 0)}
HIDDEN_DIM = 24  # the surrogates' MLP width


def held_by_kvpress(model, prompt, steps: int, weights: str) -> dict:
    import torch
    from kvpress import DMSPress, KVzapPress
    from kvpress.presses.kvzap_press import KVzapModel
    from transformers import DynamicCache

    out = {}
    for case, (threshold, window) in CASES.items():
        scorer = KVzapPress(model_type="mlp")
        scorer.kvzap_model = KVzapModel.from_pretrained(weights)
        # the name post_init_from_model derives: set, so that it keeps these surrogates instead of loading the Hub's
        scorer.kvzap_model_name = f"nvidia/KVzap-mlp-{model.config.name_or_path.split('/')[-1]}"
        press = DMSPress(press=scorer, threshold=threshold, sliding_window_size=window, decoding=True)
        cache = DynamicCache()
        with torch.no_grad():
            with press(model):  # prefill, as kvpress' pipeline runs it
                token = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[0, -1].argmax()
            tokens = [int(token)]
            with press(model):  # decoding, as its pipeline does with decoding=True
                for _ in range(steps):
                    token = model(input_ids=token.view(1, 1), past_key_values=cache,
                                  use_cache=True).logits[0, -1].argmax()
                    tokens.append(int(token))
        length = prompt.shape[1] + steps
        held = []
        for layer in model.model.layers:
            masked = layer.self_attn.masked_key_indices
            valid = torch.ones(model.config.num_key_value_heads, length, dtype=torch.bool)
            if masked is not None:
                valid[masked[1], masked[2]] = False
            held.append([head.nonzero()[:, 0].tolist() for head in valid])
        out[case] = {"held": held, "tokens": tokens}
    return out


def held_by_evalkit(model, prompt, steps: int, weights: str) -> dict:
    import evalkit.compression as ec

    out = {}
    for case, (threshold, window) in CASES.items():
        policy = ec.Threshold(threshold=threshold, sliding_window_size=window, decoding=True,
                              scorer={"name": "kvzap", "weights": weights})
        session = ec.CompressionSession(model, policy)
        token = session.prefill(prompt).argmax(-1)
        tokens = [int(token)]
        for _ in range(steps):
            token = session.step(token.view(1, 1))[0, -1].argmax()
            tokens.append(int(token))
        out[case] = {"held": [[head.tolist() for head in layer] for layer in ec.kept_positions(session)],
                     "tokens": tokens}
    return out


def decoding(side):
    """A side ``side(model, prompt, steps, weights)`` as a worker runs it, on the model :func:`save_model` wrote."""
    return lambda args: side(*load_saved(args.model), args.steps, args.weights)


SIDES = {"kvpress": Side(decoding(held_by_kvpress), reference=True), "evalkit": Side(decoding(held_by_evalkit))}


def options(parser) -> None:
    model_options(parser)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--weights")


def compare(parity: Parity, args) -> None:
    save_model(parity.folder, args.length)
    weights = str(parity.folder / "kvzap")
    shutil.copytree(from_tests("learned_files").kvzap(layers=4, input_dim=256, kv_heads=2, hidden_dim=HIDDEN_DIM),
                    weights)
    theirs_all, ours_all = parity.both("--model", str(parity.folder), "--steps", str(args.steps), "--weights", weights)
    print(f"{args.length}-token prompt, {args.steps} decode steps")
    print(f"{'case':<26} heads agreeing  positions differing  held (kvpress/evalkit)  generated evicted  same tokens")
    for case, theirs in theirs_all.items():
        ours = ours_all[case]
        same, heads, differ = agreement(theirs["held"], ours["held"])
        counts = "/".join(str(sum(len(h) for layer in side["held"] for h in layer)) for side in (theirs, ours))
        # generated tokens no longer held (per layer and head, summed): what eviction while decoding removed
        generated = "/".join(str(sum(args.steps - sum(p >= args.length for p in h) for layer in side["held"]
                                     for h in layer)) for side in (theirs, ours))
        print(f"{case:<26} {same}/{heads:<13} {differ:<20} {counts:<23} {generated:<18} "
              f"{theirs['tokens'] == ours['tokens']}")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=options, environment=kvpress_environment)
