"""Sweeps through the cluster launchers, run for real: SLURM (a single-node cluster on this machine, started by
tests/cluster/start_slurm.sh), a Ray cluster started here, and the one line a missing launcher plugin gets. A sweep on
a cluster writes the same rows as the same sweep run in this process; a job the scheduler kills resumes."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest
from helpers import evalkit
from test_resume import MEASURED

from evalkit.cli import ray_cluster_overrides
from evalkit.results import read_table

CLUSTER = Path(__file__).parent / "cluster"
SWEEP = ["+budget=2x,4x", "task=kv_retrieval", "limit=4"]
# long enough that a job is still generating when the scheduler kills it (at 24 prompts the random model's short
# answers all finished between the third generation and scancel)
LONG_PROMPTS = 96
LONG_SWEEP = ["+budget=2x,4x", "task=kv_retrieval", f"limit={LONG_PROMPTS}", "batch_size=1",
              "+task.generation.max_gen_toks=96", "task.truncation=left"]
TIMED = ["prefill_seconds", "decode_seconds", "time_to_first_token_s", "draft_seconds", "kv_byte_seconds"]


def tables(results: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A sweep's metrics and samples without what differs between any two runs of it: the run ids, when and at
    which commit they ran, and what was measured in time or memory."""
    provenance = ["run_id", "started_at", "git_revision"]
    metrics = read_table(results, "metrics")
    metrics = metrics[~metrics["metric"].isin(MEASURED)].drop(columns=provenance)
    samples = read_table(results, "samples").drop(columns=[*provenance, *TIMED])
    return (metrics.sort_values(["budget", "subset", "metric"]).reset_index(drop=True),
            samples.sort_values(["budget", "doc_id", "repeat"]).reset_index(drop=True))


def assert_same_rows(results: Path, reference: Path, samples_per_job: int) -> None:
    metrics, samples = tables(results)
    expected_metrics, expected_samples = tables(reference)
    assert len(samples) == 2 * samples_per_job and set(samples["budget"]) == {"2x", "4x"}
    assert not samples.duplicated(["budget", "doc_id", "repeat"]).any(), "a sample written twice"
    pd.testing.assert_frame_equal(samples, expected_samples)
    pd.testing.assert_frame_equal(metrics, expected_metrics)


def basic_sweep(args: list[str], model: Path, root: Path) -> Path:
    """The sweep run in this process (Hydra's basic launcher): the rows a cluster's run must match."""
    results = root / "results"
    root.mkdir(parents=True, exist_ok=True)
    done = evalkit("-m", *args, f"model.pretrained={model}", f"results_dir={results}",
                   f"hydra.sweep.dir={root / 'sweep'}", cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return results


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory, random_model_dir) -> Path:
    return basic_sweep(SWEEP, random_model_dir, tmp_path_factory.mktemp("local_sweep"))


def job_logs(sweep_dir: Path) -> str:
    """What the sweep's SLURM jobs printed (submitit keeps each job's stdout under the sweep folder)."""
    return "\n".join(path.read_text() for path in sorted((sweep_dir / ".submitit").glob("*/*_log.out")))


# --- SLURM ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm():
    """A single-node SLURM cluster on this machine (tests/cluster/start_slurm.sh); stopped at the end if this
    session started it."""
    if os.geteuid() != 0:
        pytest.skip("a SLURM cluster on this machine needs root (tests/cluster/start_slurm.sh installs and starts "
                    "slurmctld, slurmd and munged)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and there is no apt-get to install it (Debian's slurm-wlm and munge)")
    started = subprocess.run(["bash", str(CLUSTER / "start_slurm.sh")], capture_output=True, text=True, timeout=900)
    assert started.returncode == 0, f"start_slurm.sh failed:\n{started.stdout}{started.stderr}"
    yield
    if "slurmctld: started" in started.stdout and "slurmctld: stopped" not in started.stdout:  # not a restart
        subprocess.run(["bash", str(CLUSTER / "stop_slurm.sh")], capture_output=True, timeout=60)


def slurm_sweep(args: list[str], results: Path, sweep_dir: Path) -> list[str]:
    """The command line of a sweep through submitit's SLURM launcher (run with ``-m``)."""
    return ["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=10", *args,
            f"results_dir={results}", f"hydra.sweep.dir={sweep_dir}"]


def squeue(name: str, *options: str) -> list[str]:
    """The ids of this user's jobs named ``name`` that SLURM still holds."""
    listed = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i", *options], capture_output=True, text=True,
                            check=True, timeout=30)
    return listed.stdout.split()


def wait_for(condition, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.mark.slow
def test_a_sweep_on_slurm_writes_the_rows_of_a_local_sweep(slurm, tmp_path, random_model_dir, local_sweep):
    results = tmp_path / "results"
    done = evalkit(*slurm_sweep([*SWEEP, f"model.pretrained={random_model_dir}"], results, tmp_path / "sweep"),
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"evalkit: sweep of 2 jobs over budget on SlurmLauncher; each job's output under {tmp_path / 'sweep'}/" \
        in done.stdout  # the jobs went through SLURM
    assert job_logs(tmp_path / "sweep").count(" prompt prefills replayed") == 2  # each job's one line
    assert_same_rows(results, local_sweep, samples_per_job=4)


@pytest.mark.slow
def test_a_slurm_job_cancelled_mid_run_resumes_when_the_sweep_is_submitted_again(slurm, tmp_path, random_model_dir):
    """scancel kills one job of a sweep while it generates; the same sweep submitted again skips the finished job,
    resumes the cancelled one from its progress file, and the tables hold every sample once, as an uninterrupted
    sweep's do."""
    reference = basic_sweep(LONG_SWEEP, random_model_dir, tmp_path / "reference")
    results, name = tmp_path / "results", f"evalkit-test-{uuid.uuid4().hex[:8]}"
    # one job at a time: the job running when the first progress file fills is the one cancelled
    command = slurm_sweep([*LONG_SWEEP, f"model.pretrained={random_model_dir}", f"hydra.launcher.name={name}",
                           "hydra.launcher.array_parallelism=1"], results, tmp_path / "sweep1")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    driver = subprocess.Popen([sys.executable, "-m", "evalkit.cli", *command], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def generating() -> bool:
            files = list((results / ".progress").glob("*.jsonl")) if (results / ".progress").is_dir() else []
            assert driver.poll() is None, "the sweep ended before a job could be cancelled"
            return bool(files) and len(files[0].read_text().splitlines()) >= 3

        wait_for(generating, 600, "the first job's progress file to hold 3 generations", interval=0.05)
        (running,) = squeue(name, "-t", "RUNNING")
        subprocess.run(["scancel", running], check=True, timeout=30)
        wait_for(lambda: not squeue(name), 600, "the cancelled job to end and the other job to finish")
    finally:
        waiting = driver.poll() is None
        driver.terminate()
        driver.wait(timeout=60)
    # this cluster keeps no accounting (sacct): submitit cannot learn that the cancelled job ended, and waits for it
    assert waiting, "the first submission's command ended by itself"
    assert len(list((results / "metrics").glob("*.parquet"))) == 1, "expected the other job, and only it, finished"
    (progress,) = (results / ".progress").glob("*.jsonl")
    kept = [json.loads(line) for line in progress.read_text().splitlines() if line.endswith("}")]
    assert 3 <= len(kept) < LONG_PROMPTS

    again = evalkit(*slurm_sweep([*LONG_SWEEP, f"model.pretrained={random_model_dir}"], results,
                                 tmp_path / "sweep2"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    logs = job_logs(tmp_path / "sweep2")
    assert logs.count(" · already has results (") == 1, logs[-3000:]  # the finished job's line
    assert logs.count(" prompt prefills replayed") == 1, logs[-3000:]  # the resumed one's
    job_log = "\n".join(path.read_text() for path in (results / "logs").glob("*.log"))  # its own lines, in its log
    assert f"resuming: {len(kept)} generations already done" in job_log, job_log[-3000:]
    assert not list((results / ".progress").glob("*.jsonl"))
    assert_same_rows(results, reference, samples_per_job=LONG_PROMPTS)
    predictions = set(read_table(results, "samples")["prediction"])
    assert all(record["text"] in predictions for record in kept)


# --- Ray --------------------------------------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Ray's workers start sessions of their own: a process group misses them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def ray_environment(root: Path) -> dict:
    """The environment of a Ray cluster of the tests and of the drivers that join it: its own token, its own temp
    folder, and the loopback address."""
    token = root / "auth_token"
    token.write_text(secrets.token_hex(32))
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_TMPDIR": str(root),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's switch that keeps a node on 127.0.0.1
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def started_in(root: Path) -> list[int]:
    """The processes whose command line names ``root`` (Ray's daemons name their session folder), and theirs."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(root).encode() in cmdline.read_bytes():
                found.extend(descendants(int(cmdline.parent.name)))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster (2 CPUs) on the loopback address, in a temp folder of its own; yields its address and
    the environment that joins it. Stopped at the end by the ids of its processes: `ray stop` would stop every Ray
    process on the machine."""
    ray = Path(sys.executable).with_name("ray")
    if not ray.exists():
        pytest.skip("Ray is not installed: pip install 'evalkit[ray]'")
    root = Path(tempfile.mkdtemp(prefix="evalkit-ray-"))  # short: Ray's sockets live below it
    env = ray_environment(root)
    port, dashboard, client, agent = free_ports(4)
    log = root / "start.log"
    with open(log, "w") as out:
        head = subprocess.Popen(
            [str(ray), "start", "--head", "--block", f"--port={port}", "--num-cpus=2", f"--temp-dir={root}",
             "--disable-usage-stats", "--include-dashboard=false", f"--dashboard-port={dashboard}",
             f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for(lambda: "Ray runtime started" in log.read_text() or head.poll() is not None, 120,
                 "`ray start --head` to start")
        assert head.poll() is None, f"ray start --head failed:\n{log.read_text()[-3000:]}"
        yield f"127.0.0.1:{port}", env
    finally:
        stop(descendants(head.pid))
        head.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["its own", "a running one"])
def test_a_sweep_on_ray_writes_the_rows_of_a_local_sweep(cluster, request, tmp_path, random_model_dir, local_sweep,
                                                         monkeypatch):
    """Without an address the launcher starts Ray for the sweep; with one, the jobs run on that cluster."""
    if cluster == "a running one":
        address, env = request.getfixturevalue("ray_cluster")
        join = [f"hydra.launcher.ray.init.address={address}"]
    else:
        root = Path(tempfile.mkdtemp(prefix="evalkit-ray-"))
        request.addfinalizer(lambda: (stop(started_in(root)), shutil.rmtree(root, ignore_errors=True)))
        env, join = ray_environment(root), []
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    results = tmp_path / "results"
    done = evalkit("-m", "hydra/launcher=ray", *join, *SWEEP, f"model.pretrained={random_model_dir}",
                   f"results_dir={results}", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert ("Connecting to existing Ray cluster at address: " + address if join else "Started a local Ray instance") \
        in output, output[-3000:]
    assert output.count(" prompt prefills replayed") == 2  # each job's one line, relayed by Ray
    assert_same_rows(results, local_sweep, samples_per_job=4)


# --- a launcher whose plugin is not installed -------------------------------------------------------------------------

# The launcher's plugin hidden: None in sys.modules makes an import fail as for a package not installed, and Hydra's
# plugin scan (over the hydra_plugins namespace package) skips it, so Hydra does not know the launcher.
HIDDEN = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
sys.argv = ["evalkit", *sys.argv[2:]]
if sys.argv[1] == "--hydra-alone":  # Hydra's own answer, without evalkit's check
    import evalkit.cli
    sys.argv.pop(1)
    evalkit.cli._main()
else:
    runpy.run_module("evalkit.cli", run_name="__main__")
"""
PLUGINS = {"ray": ("hydra_plugins.hydra_ray_launcher,ray", "hydra-ray-launcher and ray", "ray"),
           "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher,submitit", "hydra-submitit-launcher and submitit",
                              "slurm"),
           "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher", "slurm")}


@pytest.mark.parametrize("launcher", sorted(PLUGINS))
def test_a_launcher_whose_plugin_is_missing_is_one_line_naming_the_extra(tmp_path, launcher):
    hidden, packages, extra = PLUGINS[launcher]
    args = ["-m", f"hydra/launcher={launcher}", "+budget=2x,4x", f"results_dir={tmp_path / 'results'}"]

    def run(*extra_args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", HIDDEN, hidden, *extra_args, *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    hydra_alone = run("--hydra-alone")  # the plugin is as good as not installed: Hydra does not know the launcher
    assert f"Could not find 'hydra/launcher/{launcher}'" in hydra_alone.stderr, hydra_alone.stderr[-2000:]
    done = run()
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"evalkit: config error: hydra/launcher={launcher} needs {packages}, which "
                                        f"{'are' if ' and ' in packages else 'is'} not installed: "
                                        f"pip install 'evalkit[{extra}]'"]
    assert not (tmp_path / "results").exists()


def test_a_ray_launcher_joining_a_cluster_leaves_the_object_store_size_unset(monkeypatch):
    """hydra-ray-launcher 1.2 gives ray.init an object store size, which Ray refuses when it joins a running cluster."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    joins = ["-m", "hydra/launcher=ray", "hydra.launcher.ray.init.address=10.0.0.1:6379", "+budget=2x,4x"]
    assert ray_cluster_overrides(joins) == [*joins, "+hydra.launcher.ray.init.object_store_memory=null"]
    starts = ["-m", "hydra/launcher=ray", "+budget=2x,4x"]  # a cluster of its own: the plugin's size stands
    assert ray_cluster_overrides(starts) == starts
    sized = [*joins, "+hydra.launcher.ray.init.object_store_memory=100000000"]
    assert ray_cluster_overrides(sized) == sized
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert ray_cluster_overrides(starts) == [*starts, "+hydra.launcher.ray.init.object_store_memory=null"]
    assert ray_cluster_overrides(["-m", "+budget=2x,4x"]) == ["-m", "+budget=2x,4x"]


def test_the_real_cluster_command_of_the_docs_composes_the_paper_grid_on_a_gpu_partition():
    """docs/cluster.md's command for a real SLURM cluster (a GPU partition: not run here), composed as Hydra does."""
    from hydra import compose, initialize_config_dir

    from evalkit.core.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True, overrides=[
            "+experiment=paper_grid", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
            "hydra.launcher.gpus_per_node=1", "hydra.launcher.timeout_min=1440",
            "model.pretrained=/shared/models/llama-3.1-8b-instruct", "results_dir=/shared/evalkit/results",
            "hydra.sweep.dir=/shared/evalkit/sweeps/paper_grid"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min) == ("gpu", 1, 1440)
    assert launcher.submitit_folder == "/shared/evalkit/sweeps/paper_grid/.submitit/%j"  # read by the nodes
    assert cfg.hydra.sweeper.params["method"] == "full,streaming_llm,snapkv,snapstream"
