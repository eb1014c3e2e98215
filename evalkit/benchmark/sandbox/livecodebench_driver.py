"""LiveCodeBench's grader inside the sandbox: the script :mod:`evalkit.tasks.livecodebench.livecodebench` runs there,
one process per program and problem, as lcb_runner's grade_stdio / grade_call_based run a program over all of a
problem's tests in one process: its reliability_guard first, the same rewriting of stdin programs (clean_if_name,
make_function), the same mocked stdin and captured stdout, the same module namespace ("tmp_sol", a `Solution()`
instance when the code says `class Solution`), a per-test alarm, the live `==` of call-based results.

Its stdin is one JSON object: the program (``code``), its kind (``functional`` or ``stdin``), ``func_name``,
``timeout_s`` per test, lcb_runner's ``prelude``, ``int_max_str_digits``, the report ``marker`` and the ``tests``. What
a test produced (stdin: the printed text; call-based: the verdict) goes back to the harness as one line per test after
the marker. Nothing here runs on import: it is a script, never imported by the harness.
"""

# testing_util.py's own imports, before the guard: a program's later `import numpy` finds it loaded (numpy's first
# import calls os.putenv, which the guard nulls).
import ast, datetime, decimal, enum, faulthandler, json, platform, signal, sys, time, types  # noqa: E401, F401, I001
from io import StringIO
from unittest.mock import mock_open, patch  # noqa: F401

try:
    import numpy  # noqa: F401
except ImportError:
    pass


def reliability_guard():
    # lcb_runner/evaluation/testing_util.py reliability_guard(maximum_memory_bytes=None), line for line.
    faulthandler.disable()
    import builtins
    builtins.quit = None
    import os
    os.environ["OMP_NUM_THREADS"] = "1"
    os.kill = None
    os.system = None
    os.putenv = None
    os.remove = None
    os.removedirs = None
    os.rmdir = None
    os.fchdir = None
    os.setuid = None
    os.fork = None
    os.forkpty = None
    os.killpg = None
    os.rename = None
    os.renames = None
    os.truncate = None
    os.replace = None
    os.unlink = None
    os.fchmod = None
    os.fchown = None
    os.chmod = None
    os.chown = None
    os.chroot = None
    os.fchdir = None
    os.lchflags = None
    os.lchmod = None
    os.lchown = None
    os.getcwd = None
    os.chdir = None
    import shutil
    shutil.rmtree = None
    shutil.move = None
    shutil.chown = None
    import subprocess
    subprocess.Popen = None
    builtins.help = None
    sys.modules["ipdb"] = None
    sys.modules["joblib"] = None
    sys.modules["resource"] = None
    sys.modules["psutil"] = None
    sys.modules["tkinter"] = None


def clean_if_name(code):
    try:
        astree = ast.parse(code)
        last_block = astree.body[-1]
        if isinstance(last_block, ast.If):
            condition = last_block.test
            if ast.unparse(condition).strip() == "__name__ == '__main__'":
                code = ast.unparse(astree.body[:-1]) + "\n" + ast.unparse(last_block.body)
    except:
        pass
    return code


def make_function(code):
    try:
        import_stmts, all_other_stmts = [], []
        astree = ast.parse(code)
        for stmt in astree.body:
            (import_stmts if isinstance(stmt, (ast.Import, ast.ImportFrom)) else all_other_stmts).append(stmt)
        function_ast = ast.FunctionDef(name="wrapped_function", args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[],
                                       kw_defaults=[], defaults=[]), body=all_other_stmts, decorator_list=[], lineno=-1)
        return _PRELUDE + "\n" + ast.unparse(import_stmts) + "\n" + ast.unparse(function_ast)
    except Exception:
        return code


class MockBuffer:
    def __init__(self, inputs):
        self.inputs = inputs.encode("utf-8")

    def read(self, *args):
        return self.inputs

    def readline(self, *args):
        return self.inputs.split(b"\n")[0] + b"\n"


class MockStdinWithBuffer:
    def __init__(self, inputs):
        self.inputs = inputs
        self._stringio = StringIO(inputs)
        self.buffer = MockBuffer(inputs)

    def read(self, *args):
        return self.inputs

    def readline(self, *args):
        return self._stringio.readline(*args)

    def readlines(self, *args):
        return self.inputs.split("\n")

    def __getattr__(self, name):
        return getattr(self._stringio, name)


def call_method(method, inputs):
    inputs_line_iterator = iter(inputs.split("\n"))
    mock_stdin = MockStdinWithBuffer(inputs)

    @patch("builtins.open", mock_open(read_data=inputs))
    @patch("sys.stdin", mock_stdin)
    @patch("sys.stdin.readline", lambda *args: next(inputs_line_iterator))
    @patch("sys.stdin.readlines", lambda *args: inputs.split("\n"))
    @patch("sys.stdin.read", lambda *args: inputs)
    def _inner_call_method(_method):
        try:
            return _method()
        except SystemExit:
            pass

    return _inner_call_method(method)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def _report(index, status, value=None):
    _out.write("\n" + _MARKER + json.dumps({"test": index, "status": status, "value": value}) + "\n")
    _out.flush()


if __name__ == "__main__":
    _GIVEN = json.loads(sys.stdin.read())
    sys.set_int_max_str_digits(_GIVEN["int_max_str_digits"])
    _MARKER, _KIND, _NAME, _TIMEOUT, _PRELUDE, _SOURCE = (
        _GIVEN[key] for key in ("marker", "kind", "func_name", "timeout_s", "prelude", "code"))
    _TESTS = _GIVEN["tests"]
    _out = sys.stdout
    signal.signal(signal.SIGALRM, _alarm)
    code = _PRELUDE + "\n\n" + _SOURCE if _KIND == "functional" else make_function(clean_if_name(_SOURCE))
    reliability_guard()
    signal.alarm(int(_TIMEOUT))
    try:
        module = types.ModuleType("tmp_sol", "")
        exec(code, module.__dict__)
        holder = module.Solution() if "class Solution" in code else module
    finally:
        signal.alarm(0)
    method = getattr(holder, _NAME if _KIND == "functional" else "wrapped_function", None)
    if method is None:
        _report(0, "no_function")
        sys.exit(0)
    for index, test in enumerate(_TESTS):
        test_input = test["input"]
        signal.alarm(int(_TIMEOUT))
        try:
            if _KIND == "functional":
                prediction = method(*[json.loads(line) for line in test_input.split("\n")])
                signal.alarm(0)
                if isinstance(prediction, tuple):
                    prediction = list(prediction)
                if not prediction == json.loads(test["output"]):
                    _report(index, "wrong")
                    break
                _report(index, "passed")
            else:
                captured = StringIO()
                captured.close = lambda *args: 1
                sys.stdout = captured
                try:
                    call_method(method, test_input)
                finally:
                    sys.stdout = _out
                signal.alarm(0)
                _report(index, "ok", captured.getvalue())
        except _Timeout:
            _report(index, "timeout")
            break
        except BaseException as error:
            signal.alarm(0)
            _report(index, "error", type(error).__name__)
            break
        finally:
            signal.alarm(0)
