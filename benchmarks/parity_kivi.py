"""evalkit's quantized KV numerics (:mod:`evalkit.compression.kv_format`) beside KIVI's own pure-PyTorch
quantizers (jy-yuan/KIVI ``quant/new_pack.py``: ``quant_and_pack_kcache``/``vcache``, ``unpack_and_dequant_kcache``/
``vcache``, with their bit packing), on the same seeded keys and values.

    python benchmarks/parity_kivi.py --repo KIVI

The file imports triton (for its GPU kernels) at the top; the pure functions are read out of it (``ast``) and run
without it. KIVI quantizes keys per channel over groups of ``group_size`` tokens and values per token over groups of
``group_size`` channels; evalkit's prompt quantization is compared with both, at 2, 4 and 8 bits, in float32 and
float16, and prints the largest absolute difference and whether the two are bit-identical.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

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


def compare(repo: str) -> list[tuple]:
    import torch

    import evalkit.compression as ec

    kivi = kivi_functions(repo)
    rows = []
    for dtype in (torch.float32, torch.float16):
        generator = torch.Generator().manual_seed(0)
        keys = (torch.randn(2, 4, 128, 64, generator=generator) * 2).to(dtype)
        values = torch.randn(2, 4, 128, 64, generator=generator).to(dtype)
        for bits in (2, 4, 8):
            group = 32
            code, scale, low = kivi["quant_and_pack_kcache"](keys.clone(), group, bits)
            theirs_k = kivi["unpack_and_dequant_kcache"](code, scale, low, group, bits)
            code, scale, low = kivi["quant_and_pack_vcache"](values.clone(), group, bits)
            theirs_v = kivi["unpack_and_dequant_vcache"](code, scale, low, group, bits)
            fmt = ec.KVFormat(bits, group, 128)
            held = torch.ones(keys.shape[:3], dtype=torch.bool)
            ours_k, ours_v = fmt.quantize_prompt(keys, values, held)
            for name, ours, theirs in (("keys", ours_k, theirs_k), ("values", ours_v, theirs_v)):
                theirs = theirs.to(dtype)
                rows.append((str(dtype).removeprefix("torch."), bits, name,
                             float((ours.float() - theirs.float()).abs().max()), bool(torch.equal(ours, theirs))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="a checkout of jy-yuan/KIVI")
    args = parser.parse_args()
    print(f"{'dtype':<8} {'bits':>4} {'tensor':<7} {'max |diff|':>11} {'identical':>9}")
    for dtype, bits, name, diff, same in compare(args.repo):
        print(f"{dtype:<8} {bits:>4} {name:<7} {diff:>11.3g} {str(same):>9}")


if __name__ == "__main__":
    main()
