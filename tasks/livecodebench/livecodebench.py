"""LiveCodeBench code generation: official prompts and extraction, tests run in :mod:`evalkit.benchmark.sandbox`.

Every program runs in the sandbox, one process per program over all of a problem's tests, with lcb_runner's
prelude, ``reliability_guard``, rewriting and comparisons (see :data:`PRELUDE` and the driver). Standard-input tests
are judged here, in the harness, from the text the program printed (their expected outputs never enter its process).
Call-based tests compare the live return value with ``==``, as lcb_runner does (``numpy.int64(3) == 3``,
``Counter`` or ``Decimal`` results pass as they do there), so that comparison runs inside the sandbox, which sends
back only the verdict; nothing the program returns is ever evaluated by the harness. Like the official grader's, a
call-based verdict can be forged by a program that inspects its own interpreter (an object whose ``__eq__`` always
holds passes there too): the sandbox protects the host, not the score, from such a program.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import io
import json
import logging
import math
import pickle
import secrets
import zlib
from decimal import Decimal, InvalidOperation
from pathlib import Path

from evalkit.benchmark import sandbox
from evalkit.benchmark.data import RowError, require_text

log = logging.getLogger(__name__)

HUB_REPO = "livecodebench/code_generation_lite"
RELEASE_FILES = {f"release_v{n}": ["test.jsonl"] + [f"test{i}.jsonl" for i in range(2, n + 1)] for n in range(1, 7)}
WITH_STARTER = ("You will use the following starter code to write the solution to the problem and enclose your code "
                "within delimiters.")
WITHOUT_STARTER = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test on the sample "
    "inputs). Enclose your code within delimiters as follows. Ensure that when the python program runs, it reads the "
    "inputs, runs the algorithm and writes output to STDOUT."
)
REQUIRED = ("question_title", "question_content", "platform", "question_id", "contest_date", "starter_code",
            "difficulty", "public_test_cases", "private_test_cases", "metadata")


def release_sources(release: str) -> list[str]:
    if release not in RELEASE_FILES:
        raise ValueError(f"unknown LiveCodeBench release {release!r}; choose one of {sorted(RELEASE_FILES)}")
    return [f"hf://datasets/{HUB_REPO}/{name}" for name in RELEASE_FILES[release]]


class _DataUnpickler(pickle.Unpickler):
    """Admits the data types the test field holds (strings, numbers, lists, dicts: none needs a global); refuses any
    global, which is how a pickle would reach a callable such as ``os.system``."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"test cases may hold only plain data; the pickle names {module}.{name}")


def decode_tests(field: str) -> list[dict]:
    """Test cases from their JSON string, or from the compressed form: base64 -> zlib -> pickle -> JSON string.

    The pickle comes from the dataset, as in lcb_runner, but unlike there it is decoded by :class:`_DataUnpickler`,
    which builds only plain data (a pickle that names any class or function, i.e. that would run code, is refused)."""
    if not isinstance(field, str):
        raise RowError("test cases", f"must be a string, got {type(field).__name__}")
    try:
        tests = json.loads(field)
    except json.JSONDecodeError:
        try:
            payload = io.BytesIO(zlib.decompress(base64.b64decode(field.encode("utf-8"))))
            tests = json.loads(_DataUnpickler(payload).load())
        except Exception as error:  # noqa: BLE001 (binascii, zlib, pickle and JSON each raise their own)
            raise RowError("test cases", f"neither JSON nor base64/zlib/pickle-encoded JSON ({type(error).__name__})") from None
    if not isinstance(tests, list) or any(not isinstance(t, dict) or not {"input", "output", "testtype"} <= set(t)
                                          for t in tests):
        raise RowError("test cases", "must be a list of {input, output, testtype}")
    return tests


def contest_datetime(value) -> dt.datetime:
    """``contest_date`` as lcb_runner reads it (``datetime.fromisoformat``)."""
    if isinstance(value, dt.datetime):
        return value
    try:
        return dt.datetime.fromisoformat(str(value))
    except ValueError:
        raise RowError("contest_date", f"not an ISO date/time: {value!r}") from None


def in_window(contest: dt.datetime, start_date: str | None, end_date: str | None) -> bool:
    """lcb_runner's filter: ``start <= contest_date <= end`` on full datetimes, the bounds read as ``%Y-%m-%d``
    (midnight), so a contest at 10:00 on the end date is outside."""
    start = dt.datetime.strptime(str(start_date), "%Y-%m-%d") if start_date else None
    end = dt.datetime.strptime(str(end_date), "%Y-%m-%d") if end_date else None
    return (start is None or start <= contest) and (end is None or contest <= end)


def is_date(value) -> bool:
    try:
        dt.datetime.strptime(str(value), "%Y-%m-%d")
        return True
    except ValueError:
        return False


def prepare(row: dict) -> dict:
    """Check a raw row, decode its tests and add the fields the task uses; :class:`RowError` names what is wrong."""
    require_text(row, tuple(key for key in REQUIRED if key != "contest_date"))
    if row.get("contest_date") is None:
        raise RowError("contest_date", "missing")
    contest = contest_datetime(row["contest_date"])
    public = _field_tests(row, "public_test_cases")
    tests = public + _field_tests(row, "private_test_cases")
    if not tests:
        raise RowError("private_test_cases", "no tests at all (public or private): every program would pass")
    try:
        metadata = json.loads(row["metadata"] or "{}")
    except json.JSONDecodeError:
        raise RowError("metadata", "not valid JSON") from None
    if not isinstance(metadata, dict):
        raise RowError("metadata", "must be a JSON object")
    functional = any(test["testtype"] == "functional" for test in tests)
    if functional and not metadata.get("func_name"):
        raise RowError("metadata", "functional tests but no func_name")
    return {**row, "contest_date": contest.isoformat(), "tests": json.dumps(tests),
            "func_name": metadata.get("func_name") or ""}  # lcb_runner: a func_name makes every test call-based


def _field_tests(row: dict, field: str) -> list[dict]:
    try:
        return decode_tests(row[field])
    except RowError as error:
        raise RowError(field, str(error).split(": ", 1)[-1]) from None


# lcb_runner/prompts/code_generation.py: the generic style (OpenAI-style chat: system message + user turn, stop
# "###") and the DeepSeek-R1 style (one raw prompt string with R1's own tokens, no system message, no chat template).
SYSTEM_MESSAGE_GENERIC = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will generate a "
    "correct Python program that matches the specification and passes all tests."
)
SYSTEM_MESSAGE_DEEPSEEK_R1 = (
    "<｜begin▁of▁sentence｜>A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.<｜User｜>"
)


@dataclasses.dataclass(frozen=True)
class PromptStyle:
    system_instruction: str | None  # the system turn (None: none)
    chat_template: bool  # whether the model's chat template wraps the prompt
    until: tuple[str, ...]  # stop strings of the official runner for this style


PROMPT_STYLES = {  # lcb_runner's vLLM runner stops every style at "###" (runner/vllm_runner.py, SamplingParams)
    "generic": PromptStyle(SYSTEM_MESSAGE_GENERIC, True, ("###",)),
    "deepseek_r1": PromptStyle(None, False, ("###",)),
}


def prompt(doc: dict) -> str:
    """The official prompt of ``doc["prompt_style"]`` (default generic): the user turn, or R1's whole raw prompt."""
    style = doc.get("prompt_style") or "generic"
    if style == "deepseek_r1":
        text = ("You will be given a question (problem specification) and will generate a correct Python program that "
                f"matches the specification and passes all tests.\n\nQuestion: {doc['question_content']}\n\n")
        if doc["starter_code"]:
            text += f"{WITH_STARTER}\n```python\n{doc['starter_code']}\n```\n\n"
        else:
            text += f"{WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n"
        return SYSTEM_MESSAGE_DEEPSEEK_R1 + text + "<｜Assistant｜>"
    text = f"### Question:\n{doc['question_content']}\n\n"
    if doc["starter_code"]:
        text += f"### Format: {WITH_STARTER}\n```python\n{doc['starter_code']}\n```\n\n"
    else:
        text += f"### Format: {WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n"
    return text + "### Answer: (use the provided format with backticks)\n\n"


def extract_code(response: str) -> str | None:
    """The official rule: the text between the last two lines that contain ```; None without such a pair."""
    lines = response.split("\n")
    fences = [index for index, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return None
    return "\n".join(lines[fences[-2] + 1 : fences[-1]])


# lcb_runner/evaluation/testing_util.py `import_string`, exactly: every program runs after these lines.
PRELUDE = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\nfrom heapq import *\n"
    "from bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\nfrom statistics import *\n"
    "from itertools import *\nfrom functools import *\nfrom operator import *\nfrom io import *\nfrom sys import *\n"
    "from json import *\nfrom builtins import *\nfrom typing import *\nimport string\nimport re\nimport datetime\n"
    "import collections\nimport heapq\nimport bisect\nimport copy\nimport math\nimport random\nimport statistics\n"
    "import itertools\nimport functools\nimport operator\nimport io\nimport sys\nimport json\n"
    "sys.setrecursionlimit(50000)\n"
)
INT_MAX_STR_DIGITS = 50000  # compute_code_generation_metrics.py: sys.set_int_max_str_digits(50000)

# The grader that runs inside the sandbox, lcb_runner's testing_util as a script (its docstring says how).
DRIVER = Path(sandbox.__file__).with_name("livecodebench_driver.py")


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        numbers = [Decimal(element) for element in line.split()]
    except (InvalidOperation, ValueError):
        return None
    # A NaN equals nothing (as in lcb_runner); a signalling one (`sNaN`) would raise on comparison, so it is one too.
    return None if any(number.is_nan() for number in numbers) else numbers


def _stdout_matches(output: str, expected: str) -> bool:
    """lcb_runner's grade_stdio: stripped lines, equal line by line, else element-wise equal as ``Decimal`` (exactly:
    ``1.0`` equals ``1``, ``1.0000000001`` does not)."""
    got, want = _stripped_lines(output), _stripped_lines(expected)
    if len(got) != len(want):
        return False
    for line_got, line_want in zip(got, want):
        if line_got == line_want:
            continue
        numbers_got, numbers_want = _decimals(line_got), _decimals(line_want)
        if numbers_got is None or numbers_want is None or numbers_got != numbers_want:
            return False
    return True


def _reports(stdout: str, marker: str) -> dict[int, dict]:
    """The driver's per-test reports, read as the hostile input they are (the program shares the driver's process):
    a report must be an object with an integer ``test`` and a string ``status``; anything else is ignored, so the test
    it claims has no result and fails."""
    reports: dict[int, dict] = {}
    for line in stdout.split("\n"):
        if not line.startswith(marker):
            continue
        try:
            record = json.loads(line[len(marker):])
        except ValueError:
            continue
        if (isinstance(record, dict) and type(record.get("test")) is int and isinstance(record.get("status"), str)
                and len(record["status"]) <= 64):
            reports[record["test"]] = record
    return reports


def _verdicts(result: sandbox.SandboxResult, tests: list[dict], marker: str) -> list[str]:
    """One verdict per test, in order, up to the first that did not pass (as the official grader stops there)."""
    reports = _reports(result.stdout, marker)
    verdicts = []
    for index, test in enumerate(tests):
        record = reports.get(index)
        if record is None:
            verdicts.append(result.status if result.status != "ok" else "no_result")
        elif test["testtype"] == "functional" or record["status"] != "ok" or not isinstance(record.get("value"), str):
            verdicts.append(record["status"])  # a call-based verdict is decided in the sandbox
        else:
            verdicts.append("passed" if _stdout_matches(record["value"], test["output"]) else "wrong")
        if verdicts[-1] != "passed":
            break
    return verdicts


def _job(code: str, doc: dict, timeout_s: float, memory_mb: int | None) -> tuple[dict, str]:
    tests = json.loads(doc["tests"])
    kind = "functional" if doc["func_name"] else "stdin"
    marker = f"@@evalkit-{secrets.token_hex(16)}@@"
    # lcb_runner's global timeout for one program over all tests: (timeout + 1) * tests + 5 seconds.
    total = (timeout_s + 1) * len(tests) + 5
    # A call-based test's expected output goes in, for the live `==`; a stdin test's never does.
    given = [{"input": t["input"], "output": t["output"] if kind == "functional" else None} for t in tests]
    settings = {"code": code, "kind": kind, "func_name": doc["func_name"], "timeout_s": max(1, round(timeout_s)),
                "prelude": PRELUDE, "int_max_str_digits": INT_MAX_STR_DIGITS, "marker": marker, "tests": given}
    return {"code": DRIVER.read_text(), "stdin": json.dumps(settings), "timeout_s": total, "memory_mb": memory_mb}, marker


def run_tests(code: str, doc: dict, timeout_s: float = 6.0, memory_mb: int | None = None) -> dict:
    """Run every test of ``doc`` on ``code`` in one sandboxed process (as the official grader does). ``memory_mb``:
    an address-space cap (None, official: none but the sandbox's safety cap)."""
    (result,) = run_programs([code], doc, timeout_s, memory_mb)
    return result


def run_programs(codes: list[str], doc: dict, timeout_s: float = 6.0, memory_mb: int | None = None,
                 workers: int | None = None) -> list[dict]:
    """:func:`run_tests` for several programs of one problem, on a pool of sandboxes."""
    tests = json.loads(doc["tests"])
    jobs = [_job(code, doc, timeout_s, memory_mb) for code in codes]
    results = sandbox.run_many([job for job, _ in jobs], workers=workers) if jobs else []
    out = []
    for (_, marker), result in zip(jobs, results):
        try:
            verdicts = _verdicts(result, tests, marker)
        except Exception as error:  # noqa: BLE001 (whatever a program's output does to grading, it fails; the run goes on)
            log.warning("grading a program failed (%s: %s); it counts as failing", type(error).__name__, error)
            verdicts = [f"grader_error:{type(error).__name__}"]
        out.append({"passed": len(verdicts) == len(tests) and all(v == "passed" for v in verdicts), "statuses": verdicts})
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of Chen et al. (2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def score(doc: dict, responses: list[str], timeout_s: float = 6.0, ks: tuple[int, ...] = (1, 5, 10),
          memory_mb: int | None = None) -> dict:
    """pass@k, the extraction failure rate and ``sandbox_namespaces`` (1: programs ran in the full sandbox, 0: with
    rlimits only)."""
    codes = [extract_code(response) for response in responses]
    runnable = [code for code in codes if code is not None]
    verdicts = iter(run_programs(runnable, doc, timeout_s, memory_mb))
    passed = [code is not None and next(verdicts)["passed"] for code in codes]
    n, c = len(responses), sum(passed)
    metrics = {f"pass@{k}": pass_at_k(n, c, k) if k <= n else math.nan for k in ks}  # undefined with fewer samples
    metrics["extraction_failed"] = sum(code is None for code in codes) / n
    metrics["sandbox_namespaces"] = float(sandbox.isolation_level() == "namespaces")
    return metrics
