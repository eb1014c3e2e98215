"""Hostile generated programs against the sandbox and the LiveCodeBench grader: a program that tries to read the
answers, the user's files or the host's /tmp finds nothing; one that forges or poisons its reports fails and never
stops the grader; a pickle in the data cannot run code; killing the grader takes its sandboxes with it."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest

from evalkit.benchmark import sandbox
from evalkit.benchmark.data import RowError
from evalkit.tasks.livecodebench import livecodebench as lcb
from tests.test_benchmarks import lcb_rows

pytestmark = pytest.mark.hostile
needs_namespaces = pytest.mark.skipif(not sandbox.isolation()["namespaces"],
                                      reason="Linux namespaces unavailable: the filesystem view needs them")


def _cheat_reading(path) -> str:
    """A stdin program that reads the problem's expected outputs from ``path`` and prints the one for its input."""
    return f"""```python
import json, sys
data = sys.stdin.read()
for line in open({str(path)!r}):
    for case in json.loads(json.loads(line)["public_test_cases"]):
        if case["input"] == data:
            print(case["output"], end="")
```"""


@needs_namespaces
def test_a_program_cannot_read_the_benchmarks_own_data_file(tmp_path):
    data = tmp_path / "livecodebench.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in lcb_rows()))
    doc = lcb.prepare(lcb_rows()[0])
    doc = {**doc, "tests": json.dumps(json.loads(lcb_rows()[0]["public_test_cases"]))}  # only tests the file holds
    assert lcb.score(doc, [_cheat_reading(data)], timeout_s=5)["pass@1"] == 0.0
    probe = sandbox.run(f"open({str(data)!r})")
    assert "FileNotFoundError" in probe.stderr
    # The cheat itself works wherever the file is in view: the test above fails if the view ever exposes it.
    exposed = subprocess.run([sys.executable, "-c", lcb.extract_code(_cheat_reading(data))], input="1 2\n",
                             capture_output=True, text=True)
    assert exposed.stdout == "3\n"


@needs_namespaces
def test_a_private_file_of_the_user_is_out_of_reach(tmp_path):
    folder = tmp_path / "home" / ".ssh"
    folder.mkdir(parents=True)
    key = folder / "id_ed25519"
    key.write_text("PRIVATE KEY")
    key.chmod(0o600)
    folder.chmod(0o700)
    home = os.path.expanduser("~")
    code = (f"import os\nfor path in ({str(key)!r}, {home!r}, '/etc/shadow', '/proc/1/root/etc'):\n"
            "    try:\n        print(path, open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
            "    except OSError as error:\n        print(path, type(error).__name__)")
    result = sandbox.run(code)
    assert result.status == "ok", result.stderr
    assert "PRIVATE KEY" not in result.stdout
    key_seen, home_seen, *system_seen = result.stdout.splitlines()
    assert key_seen.split()[-1] == "FileNotFoundError" and [line.split()[-1] for line in system_seen] == ["FileNotFoundError"] * 2
    # The home folder is absent, or holds only the way to a Python installed under it (pyenv, a venv) and nothing else.
    on_the_way = sorted({path[len(home) + 1:].split(os.sep)[0] for path, _ in sandbox.runtime_view()
                         if path.startswith(home + os.sep)})
    assert home_seen in (f"{home} FileNotFoundError", f"{home} {on_the_way}")


@needs_namespaces
def test_tmp_inside_the_sandbox_is_private_and_writable(tmp_path):
    marker = f"evalkit-host-only-{os.getpid()}"
    host_file = os.path.join(tempfile_dir(), marker)
    with open(host_file, "w") as handle:
        handle.write("host")
    try:
        code = (f"import os\nprint(sorted(os.listdir('/tmp')))\nprint(os.path.exists({host_file!r}))\n"
                "open('/tmp/mine', 'w').write('x')\nprint(sorted(os.listdir('/tmp')))")
        result = sandbox.run(code)
    finally:
        os.remove(host_file)
    # Empty but for the way to a Python installed under /tmp (a virtual environment there), read-only.
    on_the_way = sorted({path[len("/tmp/"):].split(os.sep)[0] for path, _ in sandbox.runtime_view()
                         if path.startswith("/tmp/")})
    assert result.stdout.splitlines() == [str(on_the_way), "False", str(sorted([*on_the_way, "mine"]))], result.stderr
    assert not os.path.exists(os.path.join(tempfile_dir(), "mine"))


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


@needs_namespaces
def test_the_python_runtime_is_in_view_read_only():
    code = (f"import sys, os\nprint(sys.version_info[:2] == {tuple(sys.version_info[:2])})\n"
            "for folder in (sys.prefix, '/', '/usr'):\n    try:\n        open(os.path.join(folder, 'planted'), 'w')\n"
            "    except OSError as error:\n        print(error.errno)")
    result = sandbox.run(code)
    assert result.stdout.split() == ["True", "30", "30", "30"], result.stderr  # 30: EROFS
    assert not os.path.exists(os.path.join(sys.prefix, "planted"))


# -- reports: everything that comes back from the sandbox is hostile input ------------------------------------------
def _forging(report: str) -> str:
    """A stdin program that writes ``report`` as the driver's own report line (it can find the marker: it shares
    the driver's interpreter) and leaves before the driver writes the true one."""
    return f"""```python
import os, sys
driver = sys.modules["__main__"]
driver._out.write("\\n" + driver._MARKER + {report!r} + "\\n")
driver._out.flush()
os._exit(0)
```"""


@pytest.mark.parametrize("report", [
    '{"test": Infinity, "status": "passed"}',
    '{"test": NaN, "status": "passed"}',
    '{"test": 1e400, "status": "passed"}',
    '{"test": 0, "status": "ok", "value": "sNaN"}',
    '{"test": 0, "status": "ok", "value": "NaN"}',
    '{"test": 0, "status": {"passed": true}}',
    '{"test": true, "status": "passed"}',
    '[0, "passed"]',
    '{"test": 0, "status": "ok", "value": "' + "9" * 5000 + 'e999999999"}',
])
def test_a_forged_or_poisoned_report_fails_the_program_and_never_the_grader(report):
    doc = lcb.prepare(lcb_rows()[0])
    doc = {**doc, "tests": json.dumps([{"input": "1 2\n", "output": "1.5\n", "testtype": "stdin"}])}
    metrics = lcb.score(doc, [_forging(report)], timeout_s=5)
    assert metrics["pass@1"] == 0.0


def test_a_program_printing_a_signalling_nan_is_simply_wrong():
    doc = lcb.prepare(lcb_rows()[0])
    doc = {**doc, "tests": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}])}
    assert lcb.score(doc, ["```python\nprint('sNaN')\n```", "```python\nprint(3)\n```"], timeout_s=5)["pass@1"] == 0.5
    assert not lcb._stdout_matches("sNaN\n", "sNaN\n".replace("s", "")) and lcb._stdout_matches("nan", "nan")


def test_grading_errors_of_one_program_do_not_stop_the_others(monkeypatch):
    doc = lcb.prepare(lcb_rows()[0])
    real = lcb._verdicts
    calls = []

    def flaky(result, tests, marker):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("grader bug")
        return real(result, tests, marker)

    monkeypatch.setattr(lcb, "_verdicts", flaky)
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    results = lcb.run_programs([lcb.extract_code(right)] * 2, doc, timeout_s=5)
    assert [r["passed"] for r in results] == [False, True]
    assert results[0]["statuses"] == ["grader_error:RuntimeError"]


# -- pickled tests in the data ----------------------------------------------------------------------------------------
class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickled_tests_that_would_run_code_are_a_data_error_and_run_nothing(tmp_path):
    planted = tmp_path / "pwned"
    field = base64.b64encode(zlib.compress(pickle.dumps(_Payload(planted)))).decode()
    with pytest.raises(RowError, match="test cases"):
        lcb.decode_tests(field)
    assert not planted.exists()
    tests = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    plain = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()
    assert lcb.decode_tests(plain) == tests  # the official encoding still decodes


# -- the grader's death ---------------------------------------------------------------------------------------------
def _cmdline(pid: int) -> bytes:
    """A process's command line; empty for one that has ended since it was listed (a short-lived helper)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not shutil.which("setpriv"), reason="util-linux setpriv missing")
def test_killing_the_grader_kills_its_sandboxes_and_the_next_start_removes_their_folders(tmp_path, monkeypatch):
    grader = subprocess.Popen(
        [sys.executable, "-c", "from evalkit.benchmark import sandbox; sandbox.run('import time; time.sleep(120)', timeout_s=120)"],
        env={**os.environ, "TMPDIR": str(tmp_path)}, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        program = [pid for pid in _descendants(grader.pid)
                   if _cmdline(pid).endswith(b"/dev/fd/3\0")]
        if program:
            break
        time.sleep(0.1)
    else:
        grader.kill()
        pytest.fail("the sandboxed program never started")
    sandboxed = _descendants(grader.pid)
    folders = [path.name for path in tmp_path.iterdir() if path.name.startswith("evalkit-sandbox-")]
    assert folders and all(name.startswith(f"evalkit-sandbox-{grader.pid}-") for name in folders)
    os.kill(grader.pid, signal.SIGKILL)
    grader.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, sandboxed)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in sandboxed if _alive(pid)], "sandbox processes outlived their grader"
    assert (tmp_path / folders[0]).exists()  # nobody was left to clean up ...
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert sandbox.remove_stale_folders() == [str(tmp_path / folders[0])]  # ... until the next start
    assert not (tmp_path / folders[0]).exists()
