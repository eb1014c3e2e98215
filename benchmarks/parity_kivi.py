"""evalkit's quantized KV numerics (:mod:`evalkit.compression.kv_format`) beside KIVI's own pure-PyTorch
quantizers (jy-yuan/KIVI ``quant/new_pack.py``: ``quant_and_pack_kcache``/``vcache``, ``unpack_and_dequant_kcache``/
``vcache``, with their bit packing), on the same seeded keys and values.

    python benchmarks/parity_kivi.py                 # evalkit against the shipped record of KIVI's outputs
    python benchmarks/parity_kivi.py --repo KIVI     # run KIVI's functions (a checkout) and record them again

The file imports triton (for its GPU kernels) at the top; the pure functions are read out of it (``ast``) and run
without it. KIVI quantizes keys per channel over groups of ``group_size`` tokens and values per token over groups of
``group_size`` channels; evalkit's prompt quantization is compared with both, at 2, 4 and 8 bits, in float32 and
float16, and prints whether the two are bit-identical (and, beside KIVI itself, the largest absolute difference).
The record (``benchmarks/records/kivi_reference.json``) keeps a SHA-256 of each of KIVI's dequantized tensors.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
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
    """The seeded keys and values of each case: ``(dtype name, bits, keys, values)``."""
    import torch

    for dtype in (torch.float32, torch.float16):
        generator = torch.Generator().manual_seed(0)
        keys = (torch.randn(2, 4, 128, 64, generator=generator) * 2).to(dtype)
        values = torch.randn(2, 4, 128, 64, generator=generator).to(dtype)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", help="a checkout of jy-yuan/KIVI: run its functions and write the record")
    args = parser.parse_args()
    ours = evalkit_outputs()
    differences = {}
    if args.repo:
        theirs = kivi_outputs(args.repo)
        differences = {key: float((ours[key].float() - theirs[key].float()).abs().max()) for key in theirs}
        revision = subprocess.run(["git", "-C", args.repo, "rev-parse", "HEAD"], capture_output=True, text=True)
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps({"reference": f"jy-yuan/KIVI {revision.stdout.strip() or '(no git)'}",
                                      "group_size": GROUP, "sha256": {k: digest(v) for k, v in theirs.items()}},
                                     indent=1))
    record = json.loads(RECORD.read_text())
    print(f"evalkit's KV quantization beside {record['reference']} quant/new_pack.py (groups of {GROUP})")
    print(f"{'dtype':<8} {'bits':>4} {'tensor':<7} {'identical':>9}" + (f" {'max |diff|':>11}" if differences else ""))
    for key, expected in record["sha256"].items():
        dtype, bits, name = key.split("/")
        line = f"{dtype:<8} {bits:>4} {name:<7} {str(digest(ours[key]) == expected):>9}"
        print(line + (f" {differences[key]:>11.3g}" if differences else ""))


GROUP = 32

if __name__ == "__main__":
    main()
