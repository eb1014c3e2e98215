"""Wrapper and learned-pattern methods beside kvpress' own presses at the model level: the same random GQA Llama and
prompt through kvpress' presses around the model's forward and evalkit's ``CompressionSession``: do they keep the
same prompt tokens, and where they rewrite them, the same keys and values?

    python benchmarks/parity_wrappers.py [--length 600] [--venv .kvpress-venv]

The model (4 layers, 8 query and 2 KV heads of 32, fp32, seeded) and prompt are parity_model.py's, saved once and
loaded by both sides, kvpress 0.5.5 in its own environment (made on demand as in bench_vs_kvpress.py; where it cannot
be made, one line and exit 0). Every budget keeps ``int(n * (1 - ratio))`` tokens per head (LU-KV: its curve's row for
that ratio sizes each layer and head) at ratios 0.5 and 0.75, ranked by SnapKV (window 64, kernel 5) unless said
otherwise.

* Methods that rewrite what they keep (key re-rotation, merging, ThinK after SnapKV): each side gives, per layer and
  KV head, its kept keys and values in the text order of their positions, the positions its SnapKV selected (kvpress:
  the ``topk`` of the scores its scorer returned, recorded; evalkit: the indices its ``rewrite`` was given,
  recorded); the table prints the largest absolute difference of keys and of values over the heads whose kept
  positions agree. (Matching contents cannot find them: in layer 0 a repeated token has the same value at every
  position, and re-rotated to its new position, the same key.)
* Methods that only choose tokens (SimLayerKV, DuoAttention, LU-KV, prefill+decoding) are compared by their kept
  positions per layer and head as in parity_model.py; for presses that mask instead of evicting (DuoAttention,
  LU-KV) kvpress' kept tokens are those its ``masked_key_indices`` leave. SimLayerKV (``n_recent`` 256) has no
  ratio: its threshold makes layers 0, 1 and 3 lazy on this prompt (their scores are 0.433, 0.434, 0.428, 0.437).
  DuoAttention's pattern (sink 16, recent 64, half the heads streaming) and LU-KV's curve are written by
  ``tests/learned_files.py`` into the model's folder and read by both sides: kvpress downloads both from GitHub by
  the model's name, so its worker replaces ``DuoAttentionPress.load_attention_pattern`` by a reader of the local
  folder and sets ``LUKVPress._budget_curves`` from the local file before the press loads its own.
* Prefill+decoding (kvpress ``PrefillDecodingPress(SnapKVPress, DecodingPress(SnapKVPress))``, re-applied every 100
  steps back to the prefill's budget) is compared after prefill and after 100 greedy decode steps, the first
  re-application included (each side its own greedy tokens; the last lines say on how many steps they agree), by the
  prompt positions the cache still holds. They differ there as evalkit's ``DecodingSnapKV`` says: kvpress gives all
  its window queries the current token's RoPE position and pools the scores along its cache in the order its
  prefill's ``topk`` left it (undo both on kvpress' side and every head agrees).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from parity_model import _held, agreement, full_keys, kept_in_cache, loaded, model_options, save_model
from parity_runner import Parity, Side, from_tests, kvpress_environment, run_parity

RATIOS = (0.5, 0.75)
SNAPKV = {"window_size": 64, "kernel_size": 5}
THINK = {"key_channel_compression_ratio": 0.5, "window_size": 32}
SIMLAYERKV = {"lazy_threshold": 0.432, "n_recent": 256}
DUO_SCORES = [[0.9, 0.1], [0.3, 0.7], [0.2, 0.8], [0.6, 0.4]]  # [layers, kv_heads]
HEAD_RATIO = 0.5
INTERVAL = STEPS = 100
# case: (kvpress' press from kvpress and the ratio, its SnapKV scorer, evalkit's method from evalkit.compression and the
# capacity, whether kvpress' cache holds the kept tokens in text order: the others hold them in ``topk``'s order)
REWRITING = {
    "key_rerotation": (lambda kp, r: kp.KeyRerotationPress(kp.SnapKVPress(compression_ratio=r, **SNAPKV)),
                       lambda press: press.press, lambda ec, c: ec.KeyRerotation.from_config(c), True),
    "merging": (lambda kp, r: kp.MergingPress(kp.SnapKVPress(compression_ratio=r, **SNAPKV)),
                lambda press: press.press, lambda ec, c: ec.Merging.from_config(c), False),
    "think": (lambda kp, r: kp.ComposedPress([kp.SnapKVPress(compression_ratio=r, **SNAPKV), kp.ThinKPress(**THINK)]),
              lambda press: press.presses[0], lambda ec, c: ec.ThinK.from_config(c, **THINK), False),
}
# case: (kvpress' press from kvpress, the ratio and the model's folder, evalkit's from evalkit.compression, the capacity
# and the folder, the ratios: None for none)
SELECTING = {
    "simlayerkv": (lambda kp, r, files: kp.SimLayerKVPress(**SIMLAYERKV),
                   lambda ec, c, files: ec.SimLayerKV(**SIMLAYERKV), (None,)),
    "duo_attention": (lambda kp, r, files: kp.DuoAttentionPress(head_compression_ratio=HEAD_RATIO),
                      lambda ec, c, files: ec.DuoAttention(patterns=str(files / "duo"), head_ratio=HEAD_RATIO),
                      (None,)),
    "lukv": (lambda kp, r, files: lukv_press(kp, r, files),
             lambda ec, c, files: ec.LUKV.from_config(c, curve=str(files / "lukv.npy")), RATIOS),
}


def lukv_press(kp, ratio: float, files: Path):
    """kvpress' ``LUKVPress`` (ExpectedAttention, epsilon 0.02) with the local curve in place of its download."""
    import numpy as np

    press = kp.LUKVPress(compression_ratio=ratio)
    press._budget_curves = np.load(files / "lukv.npy")
    return press


def local_duo_pattern(folder: Path):
    """``DuoAttentionPress.load_attention_pattern``'s reading of config.json and full_attention_heads.tsv, from a
    local folder."""
    import numpy as np

    config = json.loads((folder / "config.json").read_text())
    scores = np.clip(np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t"), 0, 1)
    return config["sink_size"], config["recent_size"], scores


def in_text_order(rows, keys, values) -> list[dict]:
    """Per KV head, the positions ``rows`` ``[H, m]`` its cache's first ``m`` rows hold, and those rows' keys and
    values in the order of their positions."""
    out = []
    for head, held in enumerate(rows):
        order = held.argsort()
        out.append({"kept": held[order].tolist(), "keys": keys[0, head, order].tolist(),
                    "values": values[0, head, order].tolist()})
    return out


def recording_scores(score, scores: dict):
    """kvpress' ``score``, each layer's scores kept in ``scores``."""

    def record(module, *args):
        scores[module.layer_idx] = score(module, *args)
        return scores[module.layer_idx]

    return record


def recording_picks(rewrite, picks: dict):
    """evalkit's ``rewrite``, each layer's kept indices (``[H, m]``, in text order) kept in ``picks``."""

    def record(view, indices, *args):
        picks[view.layer_idx] = indices[0]
        return rewrite(view, indices, *args)

    return record


def evalkit_valid(session, layer):
    """``[H, slots]``: the slots of evalkit's ``layer`` that hold a token."""
    if layer.heads is not None:
        return layer.heads.valid[0]
    return session.state.valid[0, : layer.keys.shape[-2]][None].expand(layer.keys.shape[1], -1)


def run_kvpress(model, prompt, files: Path) -> dict:
    import kvpress
    import torch
    from kvpress.presses.duo_attention_press import DuoAttentionPress
    from transformers import DynamicCache

    DuoAttentionPress.load_attention_pattern = staticmethod(lambda model: local_duo_pattern(files / "duo"))
    full, n, out = full_keys(model, prompt), prompt.shape[1], {"kept": {}, "caches": {}, "tokens": {}}

    def kept(cache) -> list[list[list[int]]]:
        return kept_in_cache(model, cache, full)

    for case, (make_press, snapkv, _, in_order) in REWRITING.items():
        for r in RATIOS:
            press, cache, scores = make_press(kvpress, r), DynamicCache(), {}
            snapkv(press).score = recording_scores(snapkv(press).score, scores)
            with torch.no_grad(), press(model):
                model(input_ids=prompt, past_key_values=cache, use_cache=True)
            caches = []
            for i, layer in enumerate(cache.layers):  # the rows kvpress' own topk kept, as it holds them
                rows = scores[i].topk(int(n * (1 - r)), dim=-1).indices[0]
                caches.append(in_text_order(rows.sort().values if in_order else rows, layer.keys, layer.values))
            out["caches"][f"{case}@{r}"] = caches
    for case, (make_press, _, ratios) in SELECTING.items():
        for r in ratios:
            cache = DynamicCache()
            with torch.no_grad(), make_press(kvpress, r, files)(model):
                model(input_ids=prompt, past_key_values=cache, use_cache=True)
            out["kept"][f"{case}@{r or '-'}"] = kept(cache)
    for r in RATIOS:
        press = kvpress.PrefillDecodingPress(kvpress.SnapKVPress(compression_ratio=r, **SNAPKV), kvpress.DecodingPress(
            kvpress.SnapKVPress(**SNAPKV), compression_interval=INTERVAL, target_size=int(n * (1 - r))))
        cache, tokens = DynamicCache(), []
        with torch.no_grad(), press(model):
            logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]
            out["kept"][f"prefill_decoding@{r}"] = kept(cache)
            for step in range(STEPS):
                tokens.append(int(logits.argmax()))
                logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                               position_ids=torch.tensor([[n + step]])).logits[:, -1]
        out["kept"][f"prefill_decoding +{STEPS}@{r}"] = kept(cache)
        out["tokens"][str(r)] = tokens
    return out


def run_evalkit(model, prompt, files: Path) -> dict:

    import evalkit.compression as ec

    full, n, out = full_keys(model, prompt), prompt.shape[1], {"kept": {}, "caches": {}, "tokens": {}}

    def kept(session) -> list[list[list[int]]]:
        return [_held(full[i], layer.keys, evalkit_valid(session, layer))
                for i, layer in enumerate(session.cache.layers)]

    for case, (_, _, make_method, _) in REWRITING.items():
        for r in RATIOS:
            method, picks = make_method(ec, int(n * (1 - r))), {}
            method.rewrite = recording_picks(method.rewrite, picks)
            method.remove_channels = False  # ThinK: the zeroed keys kvpress holds (the same logits as removed ones)
            session = ec.CompressionSession(model, method)
            session.prefill(prompt)
            out["caches"][f"{case}@{r}"] = [in_text_order(picks[i], layer.keys, layer.values)
                                            for i, layer in enumerate(session.cache.layers)]
    for case, (_, make_method, ratios) in SELECTING.items():
        for r in ratios:
            session = ec.CompressionSession(model, make_method(ec, int(n * (1 - (r or 0))), files))
            session.prefill(prompt)
            out["kept"][f"{case}@{r or '-'}"] = kept(session)
    for r in RATIOS:
        session = ec.CompressionSession(model, ec.PrefillDecoding(capacity=int(n * (1 - r)) + INTERVAL,
                                                                  interval=INTERVAL))
        logits, tokens = session.prefill(prompt), []
        out["kept"][f"prefill_decoding@{r}"] = kept(session)
        for _ in range(STEPS):
            tokens.append(int(logits.argmax()))
            logits = session.step(logits.argmax(dim=-1, keepdim=True))[:, -1]
        out["kept"][f"prefill_decoding +{STEPS}@{r}"] = kept(session)
        out["tokens"][str(r)] = tokens
    return out


def save_files(folder: Path) -> None:
    """DuoAttention's pattern (``duo``) and LU-KV's curve (``lukv.npy``) in the model's folder, as
    tests/learned_files.py writes them."""
    learned_files = from_tests("learned_files")
    shutil.copytree(learned_files.duo_pattern(DUO_SCORES, sink=16, recent=64), folder / "duo")
    shutil.copy(learned_files.lukv_curve(layers=len(DUO_SCORES), kv_heads=len(DUO_SCORES[0])), folder / "lukv.npy")


SIDES = {"kvpress": Side(loaded(run_kvpress, folder=True), reference=True),
         "evalkit": Side(loaded(run_evalkit, folder=True))}


def compare(parity: Parity, args) -> None:
    save_model(parity.folder, args.length)
    save_files(parity.folder)
    theirs, ours = parity.both("--model", str(parity.folder))
    print(f"{'method':<26} {'ratio':>5}  heads agreeing  positions differing  max |dkeys|  max |dvalues|")
    for key in [*theirs["caches"], *theirs["kept"]]:
        case, ratio = key.rsplit("@", 1)
        if key in theirs["caches"]:
            pairs = [(a, b) for la, lb in zip(theirs["caches"][key], ours["caches"][key]) for a, b in zip(la, lb)]
            same = [(a, b) for a, b in pairs if a["kept"] == b["kept"]]
            dk, dv = (max((abs(x - y) for a, b in same for ra, rb in zip(a[t], b[t]) for x, y in zip(ra, rb)),
                          default=float("nan")) for t in ("keys", "values"))
            differ = sum(len(set(a["kept"]) ^ set(b["kept"])) for a, b in pairs) // 2
            print(f"{case:<26} {ratio:>5}  {len(same)}/{len(pairs):<13} {differ:<20} {dk:>11.2e}  {dv:>12.2e}")
            continue
        same, heads, differ = agreement(theirs["kept"][key], ours["kept"][key])
        print(f"{case:<26} {ratio:>5}  {same}/{heads:<13} {differ:<20} {'-':>11}  {'-':>12}")
    for r, tokens in theirs["tokens"].items():
        agree = sum(a == b for a, b in zip(tokens, ours["tokens"][r]))
        print(f"prefill_decoding at {r}: the two sides' greedy tokens agree on {agree} of {STEPS} steps")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=model_options, environment=kvpress_environment)
