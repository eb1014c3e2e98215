"""DuoAttention's pattern estimated on the fly, beside kvpress: ``DuoAttentionPress(on_the_fly_scoring=True)`` and
evalkit's ``DuoAttention(patterns="on_the_fly")`` on the same random GQA Llama, calibration texts and prompt: each KV
head's score, the heads that stream, and the prompt positions each layer and head keeps.

    python benchmarks/parity_duo_on_the_fly.py [--length 600] [--venv .kvpress-venv]

The model (4 layers, 8 query and 2 KV heads of 32, fp32, seeded) and prompt are parity_model.py's, saved once with a
whitespace word tokenizer of its vocabulary and 80 calibration "chapters" of random words (a ``chapter`` column, as
kmfoda/booksum's): kvpress draws 50 of them with pandas and evalkit with numpy, from the same file (kvpress' worker
replaces the press module's ``load_dataset`` by a reader of it; it reads the tokenizer saved with the model, as it
does for any model). Both sides use sink 128 and recent 256 and stream half the heads (``head_ratio`` 0.5). kvpress
masks the streaming heads' middle keys in attention; its kept positions are those its ``masked_key_indices`` leave.
"""

from __future__ import annotations

import json
from pathlib import Path

from parity_model import _held, agreement, full_keys, kept_in_cache, loaded, model_options, save_model
from parity_runner import Parity, Side, kvpress_environment, run_parity

HEAD_RATIO = 0.5
CHAPTERS = 80


def save_calibration(folder: Path, vocab: int) -> None:
    """The word tokenizer (``<s>`` first) and ``calibration.jsonl`` beside the saved model."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(folder)
    generator = torch.Generator().manual_seed(5)
    lengths = torch.randint(50, 400, (CHAPTERS,), generator=generator).tolist()
    with (folder / "calibration.jsonl").open("w") as out:
        for length in lengths:
            text = " ".join(f"w{int(t)}" for t in torch.randint(3, vocab, (length,), generator=generator))
            out.write(json.dumps({"chapter": text}) + "\n")


def run_kvpress(model, prompt, folder: Path) -> dict:
    import datasets
    import torch
    from kvpress.presses import duo_attention_press as module
    from transformers import DynamicCache

    module.load_dataset = lambda name, split: datasets.Dataset.from_json(str(folder / "calibration.jsonl"))
    press = module.DuoAttentionPress(head_compression_ratio=HEAD_RATIO, on_the_fly_scoring=True)
    full, cache = full_keys(model, prompt), DynamicCache()  # first: a prefill outside the press clears its mask
    with torch.no_grad(), press(model):
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    scores = module.duo_attention_on_the_fly(model)  # cached: what the press used
    return {"scores": scores.tolist(), "streaming": press.streaming_mask.tolist(),
            "sizes": [press.sink_size, press.recent_size], "kept": kept_in_cache(model, cache, full)}


def run_evalkit(model, prompt, folder: Path) -> dict:
    from parity_wrappers import evalkit_valid
    from transformers import AutoTokenizer

    import evalkit.compression as ec
    from evalkit.compression.methods.duo_attention import ESTIMATED_RECENT, ESTIMATED_SINK, streaming_heads

    method = ec.DuoAttention(patterns="on_the_fly", head_ratio=HEAD_RATIO, calibration=str(folder / "calibration.jsonl"))
    method.bind_tokenizer(AutoTokenizer.from_pretrained(folder))
    method.bind_model(model)
    session = ec.CompressionSession(model, method)
    session.prefill(prompt)
    full = full_keys(model, prompt)
    return {"scores": method._estimated.tolist(), "streaming": streaming_heads(method._estimated, HEAD_RATIO).tolist(),
            "sizes": [ESTIMATED_SINK, ESTIMATED_RECENT],
            "kept": [_held(full[i], layer.keys, evalkit_valid(session, layer))
                     for i, layer in enumerate(session.cache.layers)]}


SIDES = {"kvpress": Side(loaded(run_kvpress, folder=True), reference=True),
         "evalkit": Side(loaded(run_evalkit, folder=True))}


def compare(parity: Parity, args) -> None:
    save_model(parity.folder, args.length)
    save_calibration(parity.folder, 1000)
    theirs, ours = parity.both("--model", str(parity.folder))
    print(f"sink, recent: kvpress {theirs['sizes']}, evalkit {ours['sizes']}")
    print("layer  kv head  kvpress score  evalkit score  |difference|  streams (kvpress, evalkit)")
    for layer, (a, b) in enumerate(zip(theirs["scores"], ours["scores"])):
        for head, (x, y) in enumerate(zip(a, b)):
            print(f"{layer:>5}  {head:>7}  {x:>13.8f}  {y:>13.8f}  {abs(x - y):>12.2e}  "
                  f"{theirs['streaming'][layer][head]!s:>5}, {ours['streaming'][layer][head]!s}")
    ordered = sorted(x for row in ours["scores"] for x in row)
    cut = round(len(ordered) * HEAD_RATIO)
    print(f"gap between the last streaming and first retrieval score (evalkit): {ordered[cut] - ordered[cut - 1]:.3e}")
    same, heads, differ = agreement(theirs["kept"], ours["kept"])
    print(f"streaming heads identical: {theirs['streaming'] == ours['streaming']}; kept positions: {same}/{heads} heads "
          f"agree, {differ} positions differ")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=model_options, environment=kvpress_environment)
