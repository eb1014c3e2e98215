"""kvpress 0.5.5's ``FinchPress`` beside evalkit's ``finch``: the same tiny Llama (tests/conftest.py's, saved once and
loaded by both sides) and prompt of distinct tokens; do they keep the same tokens per layer and KV head, and hold the
same re-rotated keys?

    /tmp/kvpress-venv/bin/python benchmarks/parity_finch.py --write tests/fixtures/kvpress_finch.json   # kvpress
    .venv/bin/python benchmarks/parity_finch.py [--fixture tests/fixtures/kvpress_finch.json]           # evalkit

* kvpress: ``context + delimiter + question`` through ``model.model`` inside the press (as its pipeline prefills the
  context; the press' embedding hook drops the delimiter and sets the window to the question's length). Kept tokens
  are the positions whose values (never rotated) the cache holds, matched to a full-cache run of the prompt.
* evalkit: the prompt without the delimiter, ``Finch(capacity=int(N * (1 - ratio)), window=<question length>)``.

``--write`` stores kvpress' kept sets (and re-rotated keys) with the prompt as the fixture tests/test_finch.py checks
evalkit against; without it, evalkit's side is compared with the fixture.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
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


def held(full, values) -> list[list[int]]:
    """Per KV head, the positions of ``full`` ``[H, T, D]`` nearest the values ``values`` (per head ``[m, D]``)."""
    import torch

    out = []
    for head in range(len(values)):
        distances = torch.cdist(values[head].double(), full[head].double())
        assert bool((distances.min(dim=1).values < 1e-4).all()), "a cached value matches no value of the prompt"
        out.append(sorted(distances.argmin(dim=1).tolist()))
    return out


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
        kept[case] = [held(f.values[0], list(layer.values[0])) for f, layer in zip(full.layers, cache.layers)]
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


def compare(theirs: dict, ours: dict) -> list[tuple[str, int, int, float | None]]:
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


def save_tiny_model(python: str, folder: str) -> None:
    """tests/conftest.py's tiny Llama, built by evalkit's environment (``python``) and saved to ``folder``."""
    code = (f"import sys; sys.path.insert(0, {str(HERE.parent / 'tests')!r}); from conftest import tiny_model; "
            f"tiny_model().save_pretrained({folder!r})")
    subprocess.run([python, "-c", code], check=True, cwd=HERE.parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="(kvpress' environment) the fixture to write kvpress' kept sets to")
    parser.add_argument("--evalkit", default=str(HERE.parent / ".venv" / "bin" / "python"),
                        help="(kvpress' environment) evalkit's python, which builds the tiny model")
    parser.add_argument("--fixture", default=str(FIXTURE), help="(evalkit's environment) the fixture to compare with")
    args = parser.parse_args()
    if args.write:
        with tempfile.TemporaryDirectory() as folder:
            save_tiny_model(args.evalkit, folder)
            theirs = run_kvpress(folder)
        fixture = {"reference": "kvpress 0.5.5", "prompt": sequence()[0].tolist(), **theirs}
        Path(args.write).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
        print(f"wrote {args.write} ({len(theirs['kept'])} cases)")
        return
    sys.path.insert(0, str(HERE.parent / "tests"))
    from conftest import tiny_model  # noqa: E402 (tests/ on the path)

    theirs = json.loads(Path(args.fixture).read_text())
    assert theirs["prompt"] == sequence()[0].tolist(), "the fixture was written for another prompt"
    print(f"{'case':<54} heads agreeing  re-rotated keys' largest gap")
    for case, same, heads, gap in compare(theirs, run_evalkit(tiny_model())):
        print(f"{case:<54} {same}/{heads:<13} {'-' if gap is None else f'{gap:.2e}'}")


if __name__ == "__main__":
    main()
