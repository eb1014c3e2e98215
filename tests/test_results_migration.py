"""Results written before tasks declared versions keep resuming: a run finds its config's earlier runs under the
digest the config had then, renames them to its digest now (tables, manifests, lm-eval's files, progress) and skips
or resumes them. The folder in tests/fixtures/results_before_task_versions was written by evalkit before the change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import evalkit

from evalkit.benchmark import FolderTask
from evalkit.core.paths import tasks_dir
from evalkit.results import manifest, migrate
from evalkit.results.tables import load_table
from evalkit.run.digest import EARLIER_DEFINITIONS, task_definition

BEFORE = Path(__file__).with_name("fixtures") / "results_before_task_versions" / "results"
FULL = ["task=kv_retrieval", "method=full", "limit=2", "device=cpu", "results_dir=results"]
SNAPKV = ["task=kv_retrieval", "method=snapkv", "budget=4x", "limit=2", "device=cpu", "results_dir=results"]
INTERRUPTED = ["task=kv_retrieval", "method=snapkv", "budget=2x", "limit=6", "batch_size=1", "device=cpu",
               "results_dir=results"]
RENAMED = {"run_id", "config_digest", "task_definition"}


# kv_retrieval's identity when task versions came: its earlier runs are its runs only while it is still so.
KV_RETRIEVAL_NOW = json.loads((tasks_dir() / EARLIER_DEFINITIONS).read_text())["kv_retrieval"]["now"]


@pytest.fixture
def results(tmp_path) -> Path:
    if task_definition(FolderTask("kv_retrieval")) != KV_RETRIEVAL_NOW:
        pytest.skip("kv_retrieval's YAML or version changed since task versions came: runs made before are not runs of "
                    "it any more, by design (nothing is renamed)")
    return Path(shutil.copytree(BEFORE, tmp_path / "results"))


def tables(folder: Path, name: str) -> dict[str, list[dict]]:
    """Each run's rows (its config digest aside) by the run id without its digest."""
    runs = {}
    for path in sorted((folder / name).glob("*.parquet")):
        head, _, tail = path.stem.rsplit("-", 2)
        rows = load_table(path, name).to_pylist()
        runs[f"{head}-{tail}"] = [{key: value for key, value in row.items() if key not in RENAMED} for row in rows]
    return runs


def test_finished_runs_from_before_task_versions_are_skipped_with_their_rows_intact(results):
    before = {name: tables(BEFORE, name) for name in ("metrics", "samples")}
    for args in (FULL, SNAPKV):
        done = evalkit(*args, cwd=results.parent)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "skipped: this config already has results" in done.stdout + done.stderr
        assert "digest before task versions was" in done.stderr and "1 finished run(s) now under" in done.stderr
    assert {name: tables(results, name) for name in before} == before  # no run redone, every row as it was
    for path in (results / "metrics").glob("*.parquet"):
        table = pq.read_table(path)
        assert set(table["run_id"].to_pylist()) == {path.stem}
        assert set(table["task_definition"].to_pylist()) == {KV_RETRIEVAL_NOW}
        document = manifest.read(results, path.stem)  # whole against its manifest, lm-eval's files moved with it
        assert document["migrated_from"] != path.stem
        for name, record in [*document["tables"].items(), *document["lm_eval"].items()]:
            assert manifest.fault(results / name, record) is None, name
    assert not list((results / "lm_eval").glob(f"*-{BEFORE_DIGESTS[0]}-*"))
    again = evalkit(*FULL, cwd=results.parent)  # once: the next run finds them under their new digest
    assert "skipped" in again.stdout + again.stderr and "before task versions" not in again.stderr


BEFORE_DIGESTS = sorted({path.stem.rsplit("-", 2)[1] for path in (BEFORE / "metrics").glob("*.parquet")})


@pytest.mark.slow(reason="generates the four requests the interrupted run left, on the tiny model")
def test_an_interrupted_run_from_before_task_versions_resumes_its_generations(results):
    done = evalkit(*INTERRUPTED, cwd=results.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the progress of an interrupted one now under" in done.stderr
    assert "resuming: 2 generations already done" in done.stdout + done.stderr
    samples = pq.read_table(next((results / "samples").glob("*-snapkv-2x-*.parquet")))
    assert len(samples) == 6 and not list((results / ".progress").glob("*.jsonl"))


def test_a_run_not_as_its_manifest_records_is_left_under_its_earlier_digest(results):
    run_id = next(path.stem for path in (results / "metrics").glob("*-full-*.parquet"))
    old = run_id.rsplit("-", 2)[1]
    samples = results / "samples" / f"{run_id}.parquet"
    samples.write_bytes(samples.read_bytes()[:-100])
    assert migrate.rename_config(results, old, "0123456789ab", {"task_definition": "x"}) == []
    assert samples.exists() and migrate.run_ids(results, old) == [run_id]
