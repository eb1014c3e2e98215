"""kvpress 0.5.5's ``RestoreKVPress`` beside evalkit's ``restorekv`` and ``restorekv_plus``: the same tiny Llama
(tests/conftest.py's, saved once and loaded by both sides), prompt and adapter files; do they keep the same tokens per
layer and KV head, hold the same restore keys and values, and generate the same tokens?

    .venv/bin/python benchmarks/parity_restorekv.py [--venv /tmp/kvpress-venv]

* The adapters: tests/learned_files.py's ``restorekv`` (``restore_embeddings.safetensors`` and a PEFT LoRA adapter on
  every linear layer of the tiny Llama, random), one folder per case. kvpress reads them as it reads
  ``higokri/RestoreKV-<model>[_plus]``: its ``hf_hub_download`` and the model's ``load_adapter`` are pointed at the
  folder (PEFT applies the LoRA there; evalkit applies the same files itself).
* kvpress: the press around the model over the prompt, its tokenizer the tiny vocabulary's reconstruction prompt
  (tests/conftest.py's ``TINY_RECONSTRUCTION``, no chat template); kept tokens are those its ``masked_key_indices``
  leave of the prompt, then the restore tokens (the cache's last ``n``, never masked); ``NEW`` greedy tokens from the
  cache, decoding after the restore tokens' positions (its pipeline's ``context_length``).
* evalkit: ``capacity = int(N * (1 - ratio))``, its restore slots the positions from ``N`` on.

Per case a row prints the layer-heads whose kept sets (prompt and restore positions) are identical, the largest
difference between the two sides' restore keys and values, and the greedy tokens agreeing before the first
difference. The ratios and token counts make kvpress' ``int(numel * (ratio + n / N))`` exact.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from parity_kvzip import NEW, _model_step, _session_step, greedy
from parity_kvzip import compare as compare_kept
from parity_runner import Parity, Side, from_tests, kvpress_environment, run_parity, venv_option

N = 64  # prompt tokens
CASES = {  # case: (evalkit's method, its settings as kvpress' press takes them, ratio, restore tokens, chunk size)
    "restorekv, ratio 0.5, 4 tokens, chunks of 32": ("restorekv", {}, 0.5, 4, 32),
    "restorekv layerwise, ratio 0.5, 8 tokens": ("restorekv", {"layerwise": True}, 0.5, 8, 2048),
    "restorekv_plus, ratio 0.25, 4 tokens, chunks of 40": ("restorekv_plus", {}, 0.25, 4, 40),
}


def sequence():
    """The prompt ``[1, N]``: seeded tokens of the tiny vocabulary (3 and up)."""
    import torch

    return torch.randint(3, 97, (1, N), generator=torch.Generator().manual_seed(7))


class ReconstructionTokenizer:
    """What KVzipPress reads of a tokenizer, in the tiny vocabulary: no chat template, and the ids of its texts."""

    chat_template = None

    def __init__(self, prompts: dict):
        self.ids = {"": [], "\n": prompts["suffix"], "\n\nRepeat the previous context exactly.": prompts["first"],
                    "\n\nRepeat the part of the previous context exactly, starting with": prompts["next"]}

    def encode(self, text: str, return_tensors=None, add_special_tokens=False):
        import torch

        return torch.tensor([self.ids[text]], dtype=torch.long)


def local_adapter(model, load_adapter, adapter: str, dropout: bool, repo: str, **kwargs) -> None:
    """``model.load_adapter`` of the Hub repository ``repo``, from the folder ``adapter``; ``dropout`` False: the
    adapter's dropout modules then put in eval mode (as shipped they are left training, the model's ``eval()``
    having run before they were made)."""
    load_adapter(adapter, **kwargs)
    if not dropout:
        model.eval()


def run_kvpress(folder: str, adapters: dict, prompts: dict, dropout: bool) -> dict:
    """Per case: the positions each layer and KV head keeps, the restore keys and values, the greedy tokens."""
    import kvpress
    import kvpress.presses.kvzip_press as kvzip_module
    import kvpress.presses.restorekv_press as restore_module
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    kvzip_module.AutoTokenizer.from_pretrained = lambda *args, **kwargs: ReconstructionTokenizer(prompts)
    prompt, out = sequence(), {}
    for case, (name, settings, ratio, _, chunk) in CASES.items():
        adapter = adapters[case]
        restore_module.hf_hub_download = lambda repo, filename, adapter=adapter: str(Path(adapter) / filename)
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
        model.load_adapter = partial(local_adapter, model, model.load_adapter, adapter, dropout)
        press = kvpress.RestoreKVPress(compression_ratio=ratio, chunk_size=chunk,
                                       kvzip_plus_normalization=name == "restorekv_plus", **settings)
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[0, -1]
        kept, keys, values = [], [], []
        for layer, held in zip(model.model.layers, cache.layers):
            total = held.keys.shape[2]  # the prompt, then the restore tokens
            masked = torch.zeros(held.keys.shape[1], total, dtype=torch.bool)
            _, heads, positions = layer.self_attn.masked_key_indices
            masked[heads, positions] = True
            kept.append([torch.nonzero(~row).flatten().tolist() for row in masked])
            keys.append(held.keys[0, :, N:].tolist())
            values.append(held.values[0, :, N:].tolist())
        tokens = greedy(logits, partial(_model_step, model, cache))
        out[case] = {"kept": kept, "keys": keys, "values": values, "tokens": tokens}
    return out


def run_evalkit(model, adapters: dict, prompts) -> dict:
    """evalkit's kept positions per case, layer and KV head, the restore slots' keys and values (by position), and
    the greedy tokens."""

    import evalkit.compression as ec

    prompt, out = sequence(), {}
    for case, (name, settings, ratio, _, chunk) in CASES.items():
        policy = ec.POLICIES[name](capacity=int(N * (1 - ratio)), chunk_size=chunk, adapter=adapters[case],
                                   **settings).with_prompts(prompts)
        session = ec.CompressionSession(model, policy)
        logits = session.prefill(prompt)[0]
        kept, keys, values = [], [], []
        for layer in session.cache.layers:
            kept.append([sorted(p[v].tolist()) for p, v in zip(layer.heads.positions[0], layer.heads.valid[0])])
            order = [[int(s) for s in p.argsort() if p[s] >= N] for p in layer.heads.positions[0]]
            keys.append([layer.keys[0, h, slots].tolist() for h, slots in enumerate(order)])
            values.append([layer.values[0, h, slots].tolist() for h, slots in enumerate(order)])
        tokens = greedy(logits, partial(_session_step, session))
        out[case] = {"kept": kept, "keys": keys, "values": values, "tokens": tokens}
    return out


def options(parser) -> None:
    venv_option(parser)
    parser.add_argument("--model")
    parser.add_argument("--adapters")
    parser.add_argument("--prompts")
    parser.add_argument("--dropout", action="store_true", help="kvpress worker: its LoRA dropout left training")


SIDES = {"kvpress": Side(lambda args: run_kvpress(args.model, json.loads(args.adapters), json.loads(args.prompts),
                                                  args.dropout), reference=True)}


def compare(parity: Parity, args) -> None:
    import dataclasses

    import torch

    conftest, learned_files = from_tests("conftest"), from_tests("learned_files")
    model = conftest.tiny_model()
    adapters = {case: str(learned_files.restorekv(tokens=tokens, seed=index))
                for index, (case, (*_, tokens, _)) in enumerate(CASES.items())}
    prompts = {key: list(value) for key, value in dataclasses.asdict(conftest.TINY_RECONSTRUCTION).items()}
    model.save_pretrained(parity.folder)
    common = ["--model", str(parity.folder), "--adapters", json.dumps(adapters), "--prompts", json.dumps(prompts)]
    runs = {"dropout off": parity.run("kvpress", *common), "as shipped": parity.run("kvpress", *common, "--dropout")}
    ours = run_evalkit(model, adapters, conftest.TINY_RECONSTRUCTION)
    print(f"{'case':<52} {'kvpress':<12} heads identical  restore K/V largest gap  greedy")
    for case in CASES:
        for mode, theirs in runs.items():
            same, heads, _, agree = compare_kept(theirs[case], ours[case])
            gap = max(float((torch.tensor(theirs[case][key]) - torch.tensor(ours[case][key])).abs().max())
                      for key in ("keys", "values"))
            print(f"{case:<52} {mode:<12} {same}/{heads:<13} {gap:<22.2e} {agree}/{NEW}")


if __name__ == "__main__":
    run_parity(__file__, __doc__, SIDES, compare, options=options, environment=kvpress_environment)
