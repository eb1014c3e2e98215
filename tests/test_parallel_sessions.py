"""Session tasks under parallel=ray: each session runs whole on one replica, and the rows are those one process
writes (SmolLM2 on needle_multiturn, both shared modes); a replica killed mid-run loses and repeats no session."""

from __future__ import annotations

import pytest
from test_parallel import _kill_one_replica_midway
from test_sessions import SMALL, needs_smollm2

from evalkit.results import read_table

TIMED = {"run_id", "started_at", "prefill_seconds", "decode_seconds", "time_to_first_token_s", "kv_byte_seconds",
         "ttft_seconds", "draft_seconds", "git_revision"}  # what differs between two runs, and the code between them
SESSIONS = ("task.dataset.per_length=4", "method=snapkv", "+budget=2x", "batch_size=2")


def _rows(results) -> object:
    samples = read_table(results, "samples")
    samples = samples.drop(columns=[c for c in samples.columns if c in TIMED])
    return samples.sort_values(["session_id", "turn"]).reset_index(drop=True)


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("mode", ["multi_turn", "multi_request"])
def test_sessions_on_two_replicas_write_the_rows_of_one_process(tmp_path, mode):
    from helpers import evalkit

    args = [*SMALL, *SESSIONS, f"task.mode={mode}", *(["task.history=gold"] if mode == "multi_turn" else [])]
    alone, sharded = tmp_path / "alone", tmp_path / "sharded"
    assert evalkit(*args, f"results_dir={alone}", cwd=tmp_path).returncode == 0
    result = evalkit(*args, f"results_dir={sharded}", "parallel=ray", "parallel.replicas=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    expected, got = _rows(alone), _rows(sharded)
    assert len(got) == 8 and not got.duplicated(["session_id", "turn"]).any()
    assert (got["prediction"].str.len() > 0).all()  # real answers, compared row for row
    pytest.importorskip("pandas.testing").assert_frame_equal(got, expected)
    metrics = read_table(sharded, "metrics").set_index(["subset", "metric"])["value"]
    assert metrics[("all", "replicas")] == 2
    assert metrics.xs("decode_tokens_per_s", level="metric").loc[["replica0", "replica1"]].gt(0).all()  # both ran


@pytest.mark.slow
@needs_smollm2
def test_a_killed_replica_answers_its_unfinished_sessions_again_whole(tmp_path):
    args = [*SMALL, *SESSIONS, "task.mode=multi_turn", "task.dataset.per_length=8", "task.generation.max_gen_toks=24",
            "batch_size=1"]
    from helpers import evalkit

    alone, sharded = tmp_path / "alone", tmp_path / "sharded"
    assert evalkit(*args, f"results_dir={alone}", cwd=tmp_path).returncode == 0
    process, _, stderr, durable = _kill_one_replica_midway(
        [*args, f"results_dir={sharded}", "parallel=ray", "parallel.replicas=2"], sharded, tmp_path, after=2)
    assert process.returncode == 0, stderr[-3000:]
    assert durable < 16, "the run finished before a replica could be killed"
    assert "unfinished sessions again" in stderr and "death 1 of 3 allowed" in stderr
    got = _rows(sharded)
    assert len(got) == 16 and not got.duplicated(["session_id", "turn"]).any()
    pytest.importorskip("pandas.testing").assert_frame_equal(got, _rows(alone))
