"""The jobs of a sweep in one process share the loaded model and replay each prompt's prefill; their rows are the
rows of the same jobs run one by one."""

from __future__ import annotations

from helpers import evalkit

from evalkit.results import read_table

COLUMNS = ["method", "budget", "doc_id", "prediction", "score", "kept_prompt_tokens", "generated_tokens",
           "kv_bytes_peak", "kv_bytes_reserved"]


def samples(results):
    return read_table(results, "samples")[COLUMNS].sort_values(["method", "budget", "doc_id"]).reset_index(drop=True)


def test_a_sweep_loads_the_model_once_replays_the_prefills_and_writes_the_rows_of_separate_runs(tmp_path,
                                                                                                random_model_dir):
    common = ("model=kv_retrieval_tiny", f"model.pretrained={random_model_dir}", "task=kv_retrieval", "limit=3")
    alone = tmp_path / "alone"
    alone.mkdir()
    for method in ("knorm", "h2o"):  # H2O replays through the fused attention-sum pass
        result = evalkit(*common, f"method={method}", "+budget=2x", cwd=alone)
        assert result.returncode == 0, result.stderr[-2000:]
    result = evalkit("-m", *common, "method=knorm,h2o", "budget=2x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    shared = [line.rsplit(" · ", 1)[1] for line in result.stdout.splitlines() if line.startswith("[")]
    assert shared == ["model loaded, 0 of 3 prompt prefills replayed", "model shared, 3 of 3 prompt prefills replayed"]
    ours, theirs = samples(tmp_path / "results"), samples(alone / "results")
    assert len(ours) == 6 and ours.equals(theirs)
