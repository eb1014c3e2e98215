"""A tokenizer checked when its model loads: a probe text (spaces, newlines, digits; and once more inside the chat
template, markers and all, where the tokenizer has one) must come back whole from an encode/decode round trip, none
of it read as the unknown or pad token.

transformers 5 honours the ``tokenizer_class`` that a checkpoint's tokenizer_config.json names, even one that does not
fit the vocabulary beside it: ``CodeLlamaTokenizer`` next to SmolLM2's byte-level vocabulary (as an older
transformers' GGUF conversion wrote it) encodes every space and newline as the unknown id, and the model would read
every prompt so. Such a tokenizer is refused in one line that names its class and the fix. A round trip that differs
only in whitespace, with nothing read as unknown, is a warning instead: some tokenizers normalize whitespace as their
model was trained with. A word-level tokenizer (a closed vocabulary split at whitespace, as the built-in tiny model's)
is probed with its own words, whitespace between them.
"""

from __future__ import annotations

from pathlib import Path

from evalkit.core.console import warn
from evalkit.core.errors import RunError

PROBE = "Probe 1: 23 apples,\n  456 pears.\n7890\n"
WORD_SEPARATORS = (" ", "\n", "  ", "\n\n", " ", "\n")


def check_tokenizer(tokenizer, pretrained: str, path: str) -> None:
    """Refuse (:class:`RunError`) a tokenizer that loses the probe text; warn where it only changes its whitespace."""
    word_level = _is_word_level(tokenizer)
    probe = _word_probe(tokenizer) if word_level else PROBE
    for where, text in _probe_texts(tokenizer, probe):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        lost = _read_as_unknown(tokenizer, text, ids)
        same_words = back.split() == text.split()
        if not lost and (same_words if word_level else back.removeprefix(" ") == text):
            continue
        said = (f"model {pretrained}: its tokenizer ({type(tokenizer).__name__}) reads the probe text {where} "
                f"{text!r} as {back!r}" + (f", {lost}" if lost else ""))
        if same_words and not lost:
            warn(f"{said}: it keeps the words but not the whitespace between them")
            return
        raise RunError(f"{said}: {_fix(path, pretrained)}")


def _probe_texts(tokenizer, probe: str) -> list[tuple[str, str]]:
    texts = [("alone", probe)]
    if getattr(tokenizer, "chat_template", None):
        try:
            texts.append(("in its chat template", tokenizer.apply_chat_template(
                [{"role": "user", "content": probe}], tokenize=False, add_generation_prompt=True)))
        except Exception:  # noqa: BLE001 (a template that cannot render one user message is said when a prompt uses it)
            pass
    return texts


def _read_as_unknown(tokenizer, text: str, ids: list[int]) -> str:
    """The unknown and pad tokens the encoding holds beyond those the text spells out, said in words ("" if none)."""
    said, seen = [], set()
    for name, kind in (("unk", "unknown"), ("pad", "pad")):
        token, index = getattr(tokenizer, f"{name}_token", None), getattr(tokenizer, f"{name}_token_id", None)
        if token is None or index is None or index in seen:
            continue
        seen.add(index)
        extra = ids.count(index) - text.count(str(token))
        if extra > 0:
            said.append(f"{extra} of its ids are the {kind} token {token} (id {index})")
    return " and ".join(said)


def _fix(path: str, pretrained: str) -> str:
    config = Path(path) / "tokenizer_config.json"
    if pretrained.startswith("gguf:"):
        return (f"delete the converted folder {path} so that evalkit converts the GGUF again with this transformers, "
                f"or remove tokenizer_class from {config}")
    if config.is_file():
        return (f"remove tokenizer_class from {config} (transformers then reads tokenizer.json as it is) or replace it "
                f"with the class the vocabulary was made for, or convert the checkpoint again")
    return ("download the checkpoint to a folder, remove tokenizer_class from its tokenizer_config.json (or name the "
            "class the vocabulary was made for), and set model.pretrained to that folder")


def _is_word_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "model", None)).__name__ == "WordLevel"


def _word_probe(tokenizer) -> str:
    """The tokenizer's first ordinary words (no special tokens), whitespace of each kind between them."""
    special = set(tokenizer.all_special_tokens)
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    words = [w for w, _ in vocabulary if w not in special and not any(c.isspace() for c in w)]
    words = words[:len(WORD_SEPARATORS) + 1]
    return "".join(word + separator for word, separator in zip(words, (*WORD_SEPARATORS, "\n")))
