"""SCBench's scorers, ported from the official code (``eval_utils.get_ground_truth``: the label; ``compute_scores.py``;
``repo_qa_utils.py``: RepoQA's function extraction and best-match BLEU): :func:`score` gives the official score of
one turn's prediction.

Standard library only (benchmarks/parity_scbench.py loads this file by path, without evalkit). The official scorers'
third-party pieces are ported here: nltk's ``sentence_bleu`` with ``SmoothingFunction().method4`` (RepoQA),
rouge_score's ROUGE-Lsum as ``evaluate.load("rouge")`` computes it (summary). RepoQA's function extraction uses
tree-sitter where ``tree_sitter_languages`` is installed (as the official code does; ``pip install -e '.[scbench]'``),
else a fallback that finds the same functions in well-formed code (:data:`CODE_EXTRACTOR` says which one runs).
"""

from __future__ import annotations

import collections
import json
import math
import re
import string


# -- compute_scores.py's scorers, ported ------------------------------------------------------------------------------
def first_int_match(prediction: str) -> str:
    """compute_scores.first_int_match: the first run of digits, or ``""``."""
    for item in re.split("[^0-9]", prediction):
        if item != "":
            return item
    return ""


def score_kv_retrieval(pred: str, label) -> float:
    """get_score_one_kv_retrieval (kv, prefix_suffix, and repoqa_and_kv's kv turns): the label as a substring."""
    return float(label in pred)


def score_passkey(pred: str, label) -> float:
    """get_score_one_passkey: the label (a digit string) equals the first digit run of the prediction."""
    if isinstance(label, list):
        label = label[0]
    return float(label == first_int_match(pred))


def score_math_find(pred: str, label) -> float:
    """get_score_one_math_find (mf): the first unsigned number of the prediction."""
    if isinstance(label, list):
        label = label[0]
    found = re.search(r"\d+\.\d+|\d+", pred)
    if found is None:
        return 0.0
    if isinstance(label, int):
        return float(int(float(found.group(0).strip())) == label)
    if isinstance(label, float):
        return float(float(found.group(0).strip()) == label)
    raise TypeError(f"Expected int or float, got {type(label)}")


def score_longdialogue_qa_eng(pred: str, label) -> float:
    """get_score_one_longdialogue_qa_eng: any item of ``label`` (upper-cased) in the upper-cased prediction. qa_eng's
    label is ``[answer]``; many_shot's is the answer string itself, so each of its characters is an item."""
    pred = pred.strip().upper()
    return float(any(item.upper() in pred for item in label))


def score_longbook_choice_eng(pred: str, label) -> float:
    """get_score_one_longbook_choice_eng: label ``[option text, letter]``; the first character if it is A-D, else
    the whole prediction, an answer prefix, or the first word that is in "ABCD"."""
    pred = pred.strip()
    if pred == "":
        return 0.0
    if pred[0] in "ABCD":
        return float(pred[0] in label)
    if pred in label:
        return 1.0
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ["answer is:", "answer:", "answer is", "option is"]:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return 0.0
        after_prefix = pred[idx + len(prefix) + 1:]
        return float(any(after_prefix.startswith(s) for s in label))
    for word in pred.split():
        if word in "ABCD":
            return float(word in label)
    return 0.0


_ZH_PUNCTUATION = set(string.punctuation + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")


def normalize_zh_answer(s: str) -> str:
    """compute_scores.normalize_zh_answer: lower-cased, punctuation and whitespace removed."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ZH_PUNCTUATION).split())


def _f1(prediction: list, ground_truth: list) -> float:
    common = collections.Counter(prediction) & collections.Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(prediction), num_same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def score_qa_f1_zh(pred: str, ground_truths) -> float:
    """qa_f1_score_zh: the best character F1 over ``ground_truths``; qa_chn passes the answer string, so each of its
    characters is a reference of its own."""
    return max([0.0, *(_f1(list(normalize_zh_answer(pred)), list(normalize_zh_answer(gt))) for gt in ground_truths)])


def score_string_match_all(pred: str, ref) -> float:
    """string_match_all (vt): the share of ``ref``'s items in the prediction (case-insensitive), rounded to 2."""
    return round(sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref), 2)


# ROUGE-Lsum of rouge_score 0.1.2 (``evaluate.load("rouge")``: no stemmer, sentences split at newlines)
_NON_ALPHANUMERIC, _SPACES, _VALID_TOKEN = re.compile(r"[^a-z0-9]+"), re.compile(r"\s+"), re.compile(r"^[a-z0-9]+$")


def _rouge_tokens(text: str) -> list[str]:
    return [t for t in _SPACES.split(_NON_ALPHANUMERIC.sub(" ", text.lower())) if _VALID_TOKEN.match(t)]


def _lcs_indices(ref: list[str], can: list[str]) -> list[int]:
    """rouge_score's ``lcs_ind``: the reference positions of one longest common subsequence (its backtrack order)."""
    table = [[0] * (len(can) + 1) for _ in range(len(ref) + 1)]
    for i in range(1, len(ref) + 1):
        row, above, token = table[i], table[i - 1], ref[i - 1]
        for j in range(1, len(can) + 1):
            row[j] = above[j - 1] + 1 if token == can[j - 1] else max(above[j], row[j - 1])
    i, j, found = len(ref), len(can), []
    while i > 0 and j > 0:
        if ref[i - 1] == can[j - 1]:
            found.append(i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return found


def score_rouge_lsum(pred: str, label: str) -> float:
    """get_score_one_longbook_sum_eng: the ROUGE-Lsum F-measure (summary-level union LCS)."""
    refs = [_rouge_tokens(s) for s in label.split("\n") if len(s)]
    cans = [_rouge_tokens(s) for s in pred.split("\n") if len(s)]
    m, n = sum(map(len, refs)), sum(map(len, cans))
    if not refs or not cans or not m or not n:
        return 0.0
    counts_r = collections.Counter(t for s in refs for t in s)
    counts_c = collections.Counter(t for s in cans for t in s)
    hits = 0
    for ref in refs:
        for token in [ref[i] for i in sorted(set().union(*(_lcs_indices(ref, can) for can in cans)))]:
            if counts_c[token] > 0 and counts_r[token] > 0:
                hits += 1
                counts_c[token] -= 1
                counts_r[token] -= 1
    recall, precision = hits / m, hits / n
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


# -- repo_qa_utils.py: RepoQA's best-match BLEU --------------------------------------------------------------------------
REPOQA_THRESHOLD = 0.8  # compute_scores reports ["scores"]["all"][0.8]["pass@1"]


def sentence_bleu(reference: list[str], hypothesis: list[str]) -> float:
    """nltk's ``sentence_bleu([reference], hypothesis, smoothing_function=SmoothingFunction().method4)`` (weights
    0.25 each, k=5)."""
    numerators, denominators = [], []
    for n in range(1, 5):
        counts = collections.Counter(zip(*(hypothesis[i:] for i in range(n)))) if len(hypothesis) >= n else {}
        ref_counts = collections.Counter(zip(*(reference[i:] for i in range(n)))) if len(reference) >= n else {}
        numerators.append(sum(min(count, ref_counts.get(gram, 0)) for gram, count in counts.items()))
        denominators.append(max(1, sum(counts.values())))
    hyp_len, ref_len = len(hypothesis), len(reference)
    bp = 1 if hyp_len > ref_len else 0 if hyp_len == 0 else math.exp(1 - ref_len / hyp_len)
    if numerators[0] == 0:
        return 0
    precisions, smoothed = [], 1
    for numerator, denominator in zip(numerators, denominators):
        if numerator == 0 and hyp_len > 1:
            precisions.append(1 / (2 ** smoothed * 5 / math.log(hyp_len)) / denominator)
            smoothed += 1
        else:
            precisions.append(numerator / denominator)
    return bp * math.exp(math.fsum(0.25 * math.log(p) for p in precisions if p > 0))


def function_similarity(candidate: str, reference: str) -> float:
    """compute_function_similarity: BLEU over whitespace-split tokens."""
    return sentence_bleu(re.split(r"\s+", reference.strip()), re.split(r"\s+", candidate.strip()))


_CODE_BLOCK = re.compile(r"^```(?:\w+)?\s*\n(.*?)(?=^```)```", re.DOTALL | re.MULTILINE)


def _tree_sitter():
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from tree_sitter_languages import get_language, get_parser

            get_parser("python")
        return get_language, get_parser
    except Exception:  # noqa: BLE001 (not installed, or an incompatible tree_sitter)
        return None


TREE_SITTER = _tree_sitter()
CODE_EXTRACTOR = "tree-sitter" if TREE_SITTER is not None else "fallback"  # what finds RepoQA's functions here


def sanitize_output(model_output: str, lang: str, extractor: str = CODE_EXTRACTOR) -> str:
    """sanitize_output: the first function ``extractor`` (tree-sitter, as the official code; or the fallback) finds
    in a code block, else the first block, else the whole (stripped) output."""
    model_output = model_output.strip()
    blocks = _CODE_BLOCK.findall(model_output)
    if not blocks:
        return model_output
    for block in blocks:
        found = first_function(block, lang, extractor)
        if found is not None:
            return found
    return blocks[0]


FUNCTION_QUERY = {  # repo_qa_utils.FUNCTION_QUERY
    "python": "(function_definition name: (_)) @fdef",
    "java": "(method_declaration name: (_)) @fdef",
    "typescript": "(function_declaration name: (_)) @fdef",
    "rust": "(function_item name: (_)) @fdef",
    "cpp": "(function_definition declarator: (function_declarator declarator: (identifier))) @fdef",
    "go": "(function_declaration name: (_)) @fdef",
}


def first_function(block: str, lang: str, extractor: str = CODE_EXTRACTOR) -> str | None:
    """The first function of the kind repo_qa_utils' query captures in ``block``, found by tree-sitter (as the
    official code does) or by :func:`heuristic_function` (``extractor="fallback"``); None if there is none."""
    if extractor != "tree-sitter":
        return heuristic_function(block, lang)
    if TREE_SITTER is None:
        raise RuntimeError("tree-sitter is not installed here: pip install -e '.[scbench]'")
    get_language, get_parser = TREE_SITTER
    try:
        data = block.encode("utf8")
        tree = get_parser(lang).parse(data)
        for node, _ in get_language(lang).query(FUNCTION_QUERY[lang]).captures(tree.root_node):
            return data[node.start_byte: node.end_byte].decode("utf8")
    except Exception:  # noqa: BLE001 (the official code's bare except)
        pass
    return None


_KEYWORDS = r"(?:return|new|else|throw|if|while|for|switch|catch|case|do|delete|goto|using|typedef|namespace|class|" \
            r"struct|enum|public|protected|private|static|final|abstract|synchronized|native|default|strictfp|" \
            r"inline|extern|virtual|explicit|constexpr|friend)\b"
_JAVA_MODIFIER = (r"(?:@[\w.]+(?:\([^)]*\))?\s+|(?:public|protected|private|static|final|abstract|synchronized|native|"
                  r"default|strictfp)\s+)")
_JAVA_GENERICS = r"<(?:[^<>]|<(?:[^<>]|<[^<>]*>)*>)*>"  # type parameters or arguments, nested twice
_HEADERS = {  # where a function tree-sitter would capture starts (group 1), and its name, at a line's start
    "go": re.compile(r"^[ \t]*(func[ \t]+\w+\s*(?:\[[^\]]*\])?\s*\()", re.MULTILINE),
    "rust": re.compile(r"^[ \t]*((?:pub(?:\s*\([^)]*\))?\s+)?(?:default\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
                       r"(?:extern\s+(?:\"[^\"]*\"\s+)?)?fn\s+\w+)", re.MULTILINE),
    "typescript": re.compile(r"^[ \t]*(?:export\s+(?:default\s+)?)?((?:async\s+)?function\s+\w+)", re.MULTILINE),
    # a method (its type's first character a letter: not the indentation), or a bare constructor (modifiers, then
    # its name), which :func:`_java_end` takes only outside braces
    "java": re.compile(r"^[ \t]*(" + _JAVA_MODIFIER + r"*(?:" + _JAVA_GENERICS + r"\s+)?(?!" + _KEYWORDS + r"|record\s|"
                       r"assert\b|yield\b)[\w$][\w$.<>\[\],? ]*?\s+\w+\s*\(|(?P<constructor>" + _JAVA_MODIFIER
                       + r"+(?:" + _JAVA_GENERICS + r"\s*)?(?!" + _KEYWORDS + r")[A-Za-z_$][\w$]*(?:\s*"
                       + _JAVA_GENERICS + r")?\s*\())", re.MULTILINE),
    "cpp": re.compile(r"^[ \t]*((?:(?:static|inline|extern|constexpr|virtual|explicit|friend)\s+)*(?!" + _KEYWORDS
                      + r")(?:(?:const|unsigned|signed|long|short)\s+)*[\w:<>,]+\s+[A-Za-z_]\w*\s*\()", re.MULTILINE),
}


def heuristic_function(block: str, lang: str) -> str | None:
    """Without tree-sitter: the first function (of the kind repo_qa_utils' query captures) in ``block``, found by
    its header and its indented body (Python) or matching braces; None if there is none."""
    if lang == "python":
        return _python_function(block)
    for match in _HEADERS[lang].finditer(block):
        end = _java_end(block, match) if lang == "java" else _body_end(block, match.end(1), lang)
        if end is not None:
            return block[match.start(1): end].rstrip()
    return None


def _python_function(block: str) -> str | None:
    """The first ``def`` (``async def``): its header up to the ``:`` outside brackets, then the lines below indented
    deeper than it (or the rest of its line)."""
    match = re.search(r"^([ \t]*)((?:async[ \t]+)?def[ \t]+\w+)", block, re.MULTILINE)
    if match is None:
        return None
    indent, depth, position = len(match.group(1).expandtabs()), 0, match.end(2)
    while position < len(block) and not (block[position] == ":" and depth == 0):
        depth += (block[position] in "([{") - (block[position] in ")]}")
        position += 1
    line_end = block.find("\n", position)
    end = line_end = len(block) if line_end < 0 else line_end
    rest = block[position + 1: line_end].strip()
    if not rest or rest.startswith("#"):
        offset = line_end + 1
        for line in block[line_end + 1:].split("\n"):
            if line.strip():
                if len(line.expandtabs()) - len(line.expandtabs().lstrip()) <= indent:
                    break
                end = offset + len(line)
            offset += len(line) + 1
    return block[match.start(2): end].rstrip()


def _body_end(block: str, position: int, lang: str) -> int | None:
    """The end of the brace-delimited body that follows ``position``, strings, characters and comments skipped: None
    when a ``;`` comes before its ``{``; the block's end when the body is not closed (tree-sitter's error recovery
    keeps such a function whole)."""
    depth, parens = 0, int(block[position - 1] == "(")
    for index, char in _code(block, position, lang):
        if char in "()" and depth == 0:
            parens += 1 if char == "(" else -1
        elif char == ";" and depth == 0 and parens == 0:
            return None
        elif char == "{" and (depth or parens == 0):
            depth += 1
        elif char == "}" and depth:
            depth -= 1
            if depth == 0:
                return index + 1
    return len(block) if depth else None


def _code(block: str, index: int = 0, lang: str = "java"):
    """``(index, character)`` of ``block`` from ``index`` on, its comments, strings and character literals skipped."""
    while index < len(block):
        if block.startswith("//", index):
            found = block.find("\n", index)
            index = len(block) if found < 0 else found
        elif block.startswith("/*", index):
            found = block.find("*/", index + 2)
            index = len(block) if found < 0 else found + 1
        elif block[index] in ("\"'`" if lang in ("typescript", "go") else '"'):
            index = _string_end(block, index, block[index])
        elif block[index] == "'" and (found := _CHAR_LITERAL.match(block, index)):
            index = found.end() - 1
        else:
            yield index, block[index]
        index += 1


_JAVA_PARAMETER = (r"(?:(?:final|@[\w.]+(?:\([^()]*\))?)\s+)*[\w$.]+(?:\s*<[^;{}()]*>)?(?:\s*\[\s*\])*"
                   r"(?:\s*\.\.\.\s*|\s+)[\w$]+(?:\s*\[\s*\])*")
_JAVA_FORMAL_PARAMETERS = re.compile(rf"\(\s*(?:{_JAVA_PARAMETER}(?:\s*,\s*{_JAVA_PARAMETER})*)?\s*\)")
_JAVA_DECLARATION_END = re.compile(r"(?:\s*\[\s*\])*(?:\s*throws\s+[\w$.<>?,\s\[\]]+?)?\s*;")


def _java_end(block: str, match: re.Match) -> int | None:
    """Where the Java function at ``match`` ends. Besides a method with a body, tree-sitter's ``method_declaration``
    is one ending in ``;`` (abstract, interface, native: ``abstract int area();``) and, outside any braces, a bare
    constructor (``public Point(int x) {...}``, read as a method whose name is missing); a constructor inside a
    class is a ``constructor_declaration``, not captured."""
    opening = match.end(1) - 1
    closing = _closing_paren(block, opening)
    if match.group("constructor") and (closing is None or _brace_depth(block, match.start(1))
                                       or not _JAVA_FORMAL_PARAMETERS.fullmatch(block, opening, closing + 1)):
        return None
    declaration = _JAVA_DECLARATION_END.match(block, closing + 1) if closing is not None else None
    return declaration.end() if declaration else _body_end(block, match.end(1), "java")


def _closing_paren(block: str, opening: int) -> int | None:
    """The ``)`` that closes the ``(`` at ``opening`` (strings and comments skipped), or None."""
    depth = 0
    for index, char in _code(block, opening):
        depth += (char == "(") - (char == ")")
        if depth == 0:
            return index
    return None


def _brace_depth(block: str, end: int) -> int:
    """How many braces are open at ``end`` (strings and comments skipped)."""
    depth = 0
    for index, char in _code(block):
        if index >= end:
            break
        depth = max(0, depth + (char == "{") - (char == "}"))
    return depth


_CHAR_LITERAL = re.compile(r"'(?:\\[^'\n]{1,8}|[^\\'\n])'")


def _string_end(block: str, index: int, quote: str) -> int:
    index += 1
    while index < len(block) and block[index] != quote:
        index += 2 if block[index] == "\\" else 1
    return index


def repoqa_best_match(prediction: str, lang: str, needles: list[dict]) -> tuple[str | None, float]:
    """needle_evaluator (ignore_comments=False): the name of the needle most similar to the sanitized prediction
    (the first of equals) and its BLEU."""
    output = sanitize_output(prediction, lang)
    best_target, best_similarity = None, 0
    for needle in needles:
        similarity = function_similarity(output, needle["needle"])
        if similarity > best_similarity:
            best_similarity, best_target = similarity, needle["name"]
    return best_target, best_similarity


def score_repoqa(pred: str, name: str, lang: str, needles: list[dict]) -> float:
    """compute_score's pass@1 at threshold 0.8 for one prediction: its best match is the asked function, with BLEU
    at least 0.8."""
    best_target, best_similarity = repoqa_best_match(pred, lang, needles)
    return float(best_target == name and best_similarity >= REPOQA_THRESHOLD)


def label(doc: dict):
    """get_ground_truth's label of a doc (choice_eng ``[text, letter]``, qa_eng ``[answer]``, else the answer)."""
    gold = json.loads(doc["target"])
    if doc["task"] == "scbench_choice_eng":
        return [gold, "ABCD"[doc["options"].index(gold)]]
    if doc["task"] == "scbench_qa_eng":
        return [gold]
    return gold


def score(doc: dict, prediction: str, needles: list[dict] | None = None) -> float:
    """The official score of one turn's prediction, by the turn's (sub-)task; a RepoQA turn's best match is picked
    from ``needles`` (default: the doc's, every loaded turn's function of its repo)."""
    task, gold = doc["task"], label(doc)
    if task == "scbench_repoqa":
        return score_repoqa(prediction, doc["name"], doc["lang"],
                            json.loads(doc["needles"]) if needles is None else needles)
    scorer = {"scbench_kv": score_kv_retrieval, "scbench_prefix_suffix": score_kv_retrieval,
              "scbench_vt": score_string_match_all, "scbench_qa_eng": score_longdialogue_qa_eng,
              "scbench_many_shot": score_longdialogue_qa_eng, "scbench_choice_eng": score_longbook_choice_eng,
              "scbench_qa_chn": score_qa_f1_zh, "scbench_mf": score_math_find, "scbench_summary": score_rouge_lsum,
              "scbench_passkey": score_passkey}[task]
    return float(scorer(prediction, gold))
