"""Data-parallel scaling: one fixed workload run in one process, then with ``parallel=ray`` over 1 and 2 replicas
(more with ``--replicas``), side by side in one run; the tables of every run compared row for row.

    python benchmarks/bench_replicas.py [--limit 64] [--replicas 1 2] [--threads 1] [--workdir DIR] [--device cpu]

The workload: a random-weight Llama (the built-in task's tokenizer, ~2M parameters) on the built-in key-value
retrieval task (``limit`` prompts of a few hundred tokens, 128 new tokens each, greedy), 4 slots per engine,
SnapStream 4x, ``--threads`` torch threads per process (one by default: replicas are compared at equal threads, not
against one process whose threads fight over cores other work also uses). Reported per configuration: the
generation's wall seconds and output tokens per second (the run's own ``wall_seconds``, generated tokens over it), the
process's end-to-end seconds (Ray's start and each replica's model load included), and the generation's speedup over
one replica.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_shared_prefill import evalkit  # one evalkit command, offline, timed

COLUMNS = ["doc_id", "prediction", "score", "generated_tokens", "kept_prompt_tokens", "kv_bytes_peak",
           "kv_bytes_reserved", "config_digest"]


def random_model(path: Path) -> Path:
    import torch

    from evalkit.models.train_tiny import build_model, build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def measured(results: Path) -> tuple[dict, object]:
    from evalkit.results import read_table

    metrics = read_table(results, "metrics")
    values = metrics[metrics["subset"] == "all"].set_index("metric")["value"]
    samples = read_table(results, "samples")
    return values, samples[COLUMNS].sort_values("doc_id").reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process (one, or per replica)")
    parser.add_argument("--workdir")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="evalkit-replicas-"))
    model = random_model(work / "model")
    common = ("task=kv_retrieval", f"model.pretrained={model}", f"limit={args.limit}", "batch_size=4",
              "+task.generation.max_gen_toks=128", "+budget=4x", f"device={args.device}", f"threads={args.threads}")
    setups = [("one process", ())] + [(f"ray, {n} replica{'s' * (n > 1)}", ("parallel=ray", f"parallel.replicas={n}"))
                                      for n in args.replicas]
    rows, reference, base = [], None, None
    for label, extra in setups:
        results = work / label.replace(" ", "_").replace(",", "")
        seconds = evalkit(*common, *extra, f"results_dir={results}", cwd=work)
        values, samples = measured(results)
        same = reference is None or samples.equals(reference)
        reference = samples if reference is None else reference
        generated = samples["generated_tokens"].sum()
        rate = generated / values["wall_seconds"]
        base = rate if base is None and extra else base
        rows.append((label, values["wall_seconds"], rate, seconds, same))
    print(f"{args.limit} prompts, {reference['generated_tokens'].sum()} output tokens, device {args.device}, "
          f"{args.threads} thread(s) per process\n")
    print("| setup | generation s | output tok/s | speedup vs 1 replica | end-to-end s | rows as one process |")
    print("|---|---|---|---|---|---|")
    for label, wall, rate, seconds, same in rows:
        speedup = f"{rate / base:.2f}x" if base else "-"
        print(f"| {label} | {wall:.1f} | {rate:,.1f} | {speedup} | {seconds:.1f} | {'yes' if same else 'NO'} |")
    if not all(same for *_, same in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
