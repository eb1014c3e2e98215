"""kvpress 0.5.5's ``FinchPress`` beside evalkit's ``finch``: the same tiny Llama (tests/conftest.py's, saved once and
loaded by both sides) and prompt of distinct tokens; do they keep the same tokens per layer and KV head, and hold the
same re-rotated keys?

    .venv/bin/python benchmarks/parity_finch.py --write tests/fixtures/kvpress_finch.json [--venv /tmp/kvpress-venv]
    .venv/bin/python benchmarks/parity_finch.py [--fixture tests/fixtures/kvpress_finch.json]

* kvpress: ``context + delimiter + question`` through ``model.model`` inside the press (as its pipeline prefills the
  context; the press' embedding hook drops the delimiter and sets the window to the question's length). Kept tokens
  are the positions whose values (never rotated) the cache holds, matched to a full-cache run of the prompt.
* evalkit: the prompt without the delimiter, ``Finch(capacity=int(N * (1 - ratio)), window=<question length>)``.

``--write`` runs kvpress 0.5.5 in its own environment (made on demand as in bench_vs_kvpress.py) and stores its kept
sets (and re-rotated keys) with the prompt as the fixture tests/test_finch.py checks evalkit against; without it,
evalkit's side is compared with the fixture.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from parity_presses import fixture_options, held
from parity_runner import HERE, Parity, Side, from_tests, kvpress_environment, run_parity, write_fixture

FIXTURE = HERE.parent / "tests" / "fixtures" / "kvpress_finch.json"
N, DELIMITER = 60, 1  # prompt length (context + question); the delimiter id, absent from the prompt
CASES = {  # case: (question tokens, compression ratio, kvpress' other settings, as evalkit's)
    "question 8, ratio 0.5": (8, 0.5, {}),
    "question 12, ratio 0.25, unnormalized, no rerotation": (12, 0.25, {"normalize_scores": False,
                                                                         "rerotate_keys": False}),
    "question 8, ratio 0.5, chunks of 20": (8, 0.5, {"chunk_length": 20}),
    "question 5, ratio 0.6, chunks of 25, no rerotation": (5, 0.6, {"chunk_length": 25, "rerotate_keys": False}),
}


def sequence():
    """The prompt ``[1, N]``, distinct tokens (3 and up: the delimiter and specials stay out)."""
    import torch

    return (3 + torch.randperm(94, generator=torch.Generator().manual_seed(0))[:N])[None]


def run_kvpress(folder: str) -> dict:
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    prompt = sequence()
    full = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=prompt, past_key_values=full)
    kept, keys = {}, {}
    for case, (question, ratio, settings) in CASES.items():
        press, cache = kvpress.FinchPress(compression_ratio=ratio, **settings), DynamicCache()
        press.delimiter_token_id = DELIMITER  # what update_model_and_tokenizer sets from the tokenizer
        ids = torch.cat([prompt[:, : N - question], torch.tensor([[DELIMITER]]), prompt[:, N - question :]], dim=1)
        with torch.no_grad(), press(model):
            model.model(input_ids=ids, past_key_values=cache)
        kept[case] = [held(f.values[0], list(layer.values[0]), tolerance=1e-4, what="value")
                      for f, layer in zip(full.layers, cache.layers)]
        if press.rerotate_keys:  # each head's kept keys in text order, re-rotated
            keys[case] = [layer.keys[0].tolist() for layer in cache.layers]
    return {"kept": kept, "keys": keys}


def evalkit_method(case: str):
    import evalkit.compression as ec

    question, ratio, settings = CASES[case]
    return ec.Finch(capacity=int(N * (1 - ratio)), window=question, **settings)


def run_evalkit(model) -> dict:
    """evalkit's kept positions per case, layer and KV head, and the keys its cache holds for them (text order)."""
    import evalkit.compression as ec

    prompt, kept, keys = sequence(), {}, {}
    for case in CASES:
        policy = evalkit_method(case)
        session = ec.CompressionSession(model, policy)
        session.prefill(prompt)
        kept[case] = [[head.tolist() for head in layer] for layer in ec.kept_positions(session)]
        if policy.rerotate_keys:
            keys[case] = [layer.keys[0, :, : len(kept[case][i][0])].tolist()
                          for i, layer in enumerate(session.cache.layers)]
    return {"kept": kept, "keys": keys}


def compare_kept(theirs: dict, ours: dict) -> list[tuple[str, int, int, float | None]]:
    """Per case: heads agreeing, heads in all, and the largest re-rotated key difference (None: no re-rotation)."""
    import torch

    rows = []
    for case, kept in theirs["kept"].items():
        pairs = [(a, b) for la, lb in zip(kept, ours["kept"][case]) for a, b in zip(la, lb)]
        gap = None
        if case in theirs["keys"]:
            gap = float((torch.tensor(theirs["keys"][case]) - torch.tensor(ours["keys"][case])).abs().max())
        rows.append((case, sum(a == b for a, b in pairs), len(pairs), gap))
    return rows


def options(parser) -> None:
    fixture_options(parser, "run kvpress (in its environment) and write its kept sets to this fixture")
    parser.add_argument("--fixture", default=str(FIXTURE), help="the fixture to compare with")


def environment(args) -> Path | None:
    """kvpress' interpreter where it runs (``--write``); else the fixture is kvpress' side."""
    return kvpress_environment(args) if args.write else Path(sys.executable)


SIDES = {"kvpress": Side(lambda args: run_kvpress(args.model), reference=True)}


def compare(parity: Parity, args) -> None:
    if args.write:
        from_tests("conftest").tiny_model().save_pretrained(parity.folder)
        theirs = parity.run("kvpress", "--model", str(parity.folder))
        write_fixture(args.write, {"prompt": sequence()[0].tolist(), **theirs})
        print(f"wrote {args.write} ({len(theirs['kept'])} cases)")
        return
    theirs = json.loads(Path(args.fixture).read_text())
    assert theirs["prompt"] == sequence()[0].tolist(), "the fixture was written for another prompt"
    print(f"{'case':<54} heads agreeing  re-rotated keys' largest gap")
    for case, same, heads, gap in compare_kept(theirs, run_evalkit(from_tests("conftest").tiny_model())):
        print(f"{case:<54} {same}/{heads:<13} {'-' if gap is None else f'{gap:.2e}'}")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=options, environment=environment)
