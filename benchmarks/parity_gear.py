"""evalkit's GEAR (:mod:`evalkit.compression.methods.gear`) beside the official functions (opengear-project/GEAR,
``GenerationBench/GenerationTest/GEARLM/Simulated/compress_function.py``: ``compress_insert_function`` with
``compress_method="GEAR"`` at prefill, which runs ``gearslkivi_channelQ_new`` on the keys and
``gearslkivi_tokenQ_new`` on the values), on the same seeded fp16 keys and values and the same seed of the global
generator the official power iteration draws from.

    python benchmarks/parity_gear.py --repo PATH     # a checkout of opengear-project/GEAR
    python benchmarks/parity_gear.py --git GITDIR    # a bare clone: the two files read with git show

The official files are copied into a temporary folder and imported by a separate Python process (they need torch
and numpy only, no install; the worker never imports evalkit); it hands back its tensors, and this process computes
evalkit's on the same inputs and prints the largest absolute difference per case (fp16 outputs: 0 means
bit-identical)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from parity_runner import Parity, Side, run_parity

SOURCE = "GenerationBench/GenerationTest/GEARLM/Simulated"
FILES = ("compress_function.py", "compress_config.py")
# (kv heads, tokens, head dim, bits, group size, outlier ratio, rank, loop)
CASES = [(8, 256, 128, 2, 64, 0.02, 4, 3), (8, 256, 128, 4, 64, 0.02, 4, 3), (2, 192, 64, 2, 32, 0.1, 2, 2),
         (4, 320, 64, 4, 128, 0.05, 8, 1), (1, 100, 64, 2, 64, 0.0, 4, 3)]


def official_outputs(args) -> list:
    """Per case: the seeded fp16 keys and values, and what the official ``compress_insert_function`` (its two files
    imported from a temporary folder: torch and numpy only) made of them."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        extract(args, Path(folder))
        sys.path.insert(0, folder)
        from compress_config import CompressionConfig
        from compress_function import compress_insert_function

        out = []
        for index, (heads, tokens, dim, bits, group, ratio, rank, loop) in enumerate(CASES):
            generator = torch.Generator().manual_seed(index)
            key = torch.randn(1, heads, tokens, dim, generator=generator).half()
            value = torch.randn(1, heads, tokens, dim, generator=generator).half()
            config = CompressionConfig(compress_method="GEAR", attention_number=1, quantize_bit=bits,
                                       group_size=group, rank=rank, rankv=rank, prefill_rank=rank, prefill_rankv=rank,
                                       loop=loop, left=ratio)
            config.copy_for_all_attention()
            config.group_size, config.token_preserving = [group], [False]
            torch.manual_seed(100 + index)
            k, v = compress_insert_function(key.clone(), value.clone(), config, 0, prefill=True)
            out.append((key, value, k, v))
    return out


def extract(args, folder: Path) -> None:
    for name in FILES:
        if args.repo:
            text = (Path(args.repo) / SOURCE / name).read_text()
        else:
            text = subprocess.run(["git", "-C", args.git, "show", f"HEAD:{SOURCE}/{name}"], check=True,
                                  capture_output=True, text=True).stdout
        (folder / name).write_text(text)


def options(parser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--repo")
    where.add_argument("--git")


def compare(parity: Parity, args) -> None:
    import torch

    from evalkit.compression.methods.gear import gear_one

    official = parity.run("official", *(["--repo", args.repo] if args.repo else ["--git", args.git]))
    print("heads tokens dim bits group outliers rank loop | max |K - K_official| max |V - V_official|  (fp16)")
    for index, (case, (key, value, k_ref, v_ref)) in enumerate(zip(CASES, official)):
        heads, tokens, dim, bits, group, ratio, rank, loop = case
        generator = torch.Generator().manual_seed(100 + index)
        ours = [gear_one(x[0].float(), is_keys, bits, group, ratio, rank, loop, generator, torch.float16)
                for x, is_keys in ((key, True), (value, False))]
        k_diff = (ours[0].float() - k_ref[0].float()).abs().max().item()
        v_diff = (ours[1].float() - v_ref[0].float()).abs().max().item()
        changed = (ours[1].float() - value[0].float()).abs().max().item()
        print(f"{heads:5} {tokens:6} {dim:3} {bits:4} {group:5} {ratio:8} {rank:4} {loop:4} | {k_diff:20.3g} "
              f"{v_diff:20.3g}   (|V - V_input| up to {changed:.3g})")


if __name__ == "__main__":
    run_parity(__file__, __doc__, {"official": Side(official_outputs, pickled=True)}, compare, options=options)
