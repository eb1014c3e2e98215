"""evalkit's quantized KV numerics (:mod:`evalkit.compression.kv_format`) beside KIVI's own pure-PyTorch quantizers
(jy-yuan/KIVI ``quant/new_pack.py``: ``quant_and_pack_kcache``/``vcache``, ``unpack_and_dequant_kcache``/``vcache``,
with their bit packing) and beside transformers' own quantized cache (``QuantoQuantizedLayer``, optimum-quanto's
``MaxOptimizer``, keys per channel: ``axis_key=-1``, values per token: ``axis_value=0``, ``q_group_size`` 32), on
the same seeded keys and values.

    python benchmarks/parity_kivi.py                    # evalkit against the shipped records of both
    python benchmarks/parity_kivi.py --repo KIVI        # run KIVI's functions (a checkout) and record them again
    python benchmarks/parity_kivi.py --quanto [VENV]    # run transformers' quanto layer (its own environment, made on
                                                        # demand: optimum-quanto and this transformers) and record it

KIVI's file imports triton (for its GPU kernels) at the top; the pure functions are read out of it (``ast``) and run
without it. The cases: float32 and float16, 2/4/8 bits (quanto: 2 and 4), keys and values of ``[2, 4, 128, 64]``.
Each line says whether evalkit's tensor is bit-identical to the reference's (and, where the reference ran now, the
largest absolute difference). The record (``benchmarks/records/kivi_reference.json``) keeps a SHA-256 of each of the
references' dequantized tensors. Where they apply: transformers quantizes the whole history again every
``residual_length`` tokens and the whole prompt at once; KIVI and evalkit keep a full-precision residual.
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from parity_runner import HERE, Parity, Side, run_parity

RECORD = HERE / "records" / "kivi_reference.json"

FUNCTIONS = ("quant_and_pack_kcache", "quant_and_pack_vcache", "unpack_and_dequant_kcache",
             "unpack_and_dequant_vcache", "pack_tensor", "unpack_tensor")


def kivi_functions(repo: str) -> dict:
    """KIVI's pure-PyTorch quantizers, read out of its ``quant/new_pack.py``."""
    import numpy as np
    import torch

    source = (Path(repo) / "quant" / "new_pack.py").read_text()
    tree = ast.parse(source)
    chosen = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS]
    missing = set(FUNCTIONS) - {node.name for node in chosen}
    if missing:
        raise SystemExit(f"KIVI's new_pack.py lacks {sorted(missing)}")
    namespace = {"torch": torch, "np": np}
    exec(compile(ast.Module(body=chosen, type_ignores=[]), "new_pack.py", "exec"), namespace)
    return namespace


def inputs():
    """The seeded keys and values of each case: ``(dtype name, bits, keys, values)``. Whole numbers over 1024 drawn
    by ``randint``: the same on every CPU (``randn``'s vector kernels draw other numbers than its portable one)."""
    import torch

    for dtype in (torch.float32, torch.float16):
        generator = torch.Generator().manual_seed(0)
        keys = (torch.randint(-6144, 6145, (2, 4, 128, 64), generator=generator) / 1024).to(dtype)
        values = (torch.randint(-3072, 3073, (2, 4, 128, 64), generator=generator) / 1024).to(dtype)
        for bits in (2, 4, 8):
            yield str(dtype).removeprefix("torch."), bits, keys, values


def digest(tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def kivi_outputs(repo: str) -> dict:
    """KIVI's dequantized keys and values of every case, by ``dtype/bits/tensor``."""
    kivi, out = kivi_functions(repo), {}
    for dtype, bits, keys, values in inputs():
        code, scale, low = kivi["quant_and_pack_kcache"](keys.clone(), GROUP, bits)
        out[f"{dtype}/{bits}/keys"] = kivi["unpack_and_dequant_kcache"](code, scale, low, GROUP, bits).to(keys.dtype)
        code, scale, low = kivi["quant_and_pack_vcache"](values.clone(), GROUP, bits)
        out[f"{dtype}/{bits}/values"] = kivi["unpack_and_dequant_vcache"](code, scale, low, GROUP, bits).to(keys.dtype)
    return out


def evalkit_outputs() -> dict:
    import torch

    import evalkit.compression as ec

    out = {}
    for dtype, bits, keys, values in inputs():
        held = torch.ones(keys.shape[:3], dtype=torch.bool)
        out[f"{dtype}/{bits}/keys"], out[f"{dtype}/{bits}/values"] = ec.KVFormat(bits, GROUP, 128).quantize_prompt(
            keys, values, held)
    return out


def quanto_outputs() -> dict:
    """transformers' ``QuantoQuantizedLayer`` quantizing and dequantizing each case (2 and 4 bits: quanto's)."""
    from transformers.cache_utils import QuantoQuantizedLayer

    out = {}
    for dtype, bits, keys, values in inputs():
        if bits == 8:
            continue
        layer = QuantoQuantizedLayer(nbits=bits, axis_key=-1, axis_value=0, q_group_size=GROUP)
        out[f"{dtype}/{bits}/keys"] = layer._dequantize(layer._quantize(keys.contiguous(), axis=-1))
        out[f"{dtype}/{bits}/values"] = layer._dequantize(layer._quantize(values.contiguous(), axis=0))
    return out


def quanto_record(args) -> dict:
    """The record entry of transformers' quanto layer (its worker, in its own environment)."""
    from importlib.metadata import version

    import transformers

    return {"reference": f"transformers {transformers.__version__} QuantoQuantizedLayer (optimum-quanto "
                         f"{version('optimum-quanto')}), axis_key=-1, axis_value=0",
            "sha256": {k: digest(v) for k, v in quanto_outputs().items()}}


def quanto_environment(args) -> Path:
    """With ``--quanto``: the interpreter of transformers' quanto backend (this transformers and optimum-quanto),
    made on demand."""
    if not args.quanto:
        return Path(sys.executable)
    import transformers
    from bench_vs_kvpress import reference_python

    python = reference_python(Path(args.quanto), ["optimum-quanto", f"transformers=={transformers.__version__}"],
                              "import optimum.quanto, transformers", "transformers' quanto backend",
                              "its own environment")
    if python is None:
        raise SystemExit("transformers' quanto backend could not be installed")
    return python


def options(parser) -> None:
    parser.add_argument("--repo", help="a checkout of jy-yuan/KIVI: run its functions and write the record")
    parser.add_argument("--quanto", nargs="?", const=str(HERE.parent / ".quanto-venv"),
                        help="run transformers' quanto layer in this environment and write the record")


def compare(parity: Parity, args) -> None:
    ours = evalkit_outputs()
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    differences = {}
    if args.repo:
        theirs = kivi_outputs(args.repo)
        differences = {f"kivi/{key}": float((ours[key].float() - theirs[key].float()).abs().max()) for key in theirs}
        revision = subprocess.run(["git", "-C", args.repo, "rev-parse", "HEAD"], capture_output=True, text=True)
        record["kivi"] = {"reference": f"jy-yuan/KIVI {revision.stdout.strip() or '(no git)'} quant/new_pack.py",
                          "sha256": {k: digest(v) for k, v in theirs.items()}}
    if args.quanto:
        record["transformers"] = parity.run("quanto")
    if args.repo or args.quanto:
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1))
    for name, entry in record.items():
        print(f"evalkit's KV quantization (groups of {GROUP}) beside {entry['reference']}")
        print(f"{'reference':<13} {'dtype':<8} {'bits':>4} {'tensor':<7} {'identical':>9}")
        for key, expected in entry["sha256"].items():
            dtype, bits, tensor = key.split("/")
            line = f"{name:<13} {dtype:<8} {bits:>4} {tensor:<7} {str(digest(ours[key]) == expected):>9}"
            print(line + (f" {differences[f'{name}/{key}']:>11.3g}" if f"{name}/{key}" in differences else ""))


GROUP = 32

if __name__ == "__main__":
    run_parity(__file__, __doc__, {"quanto": Side(quanto_record, reference=True)}, compare, options=options,
               environment=quanto_environment)
