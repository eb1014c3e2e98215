"""kvpress' budget convention beside evalkit's: ``budget=removed_R`` removes the fraction R of each prompt (kvpress'
``compression_ratio``: ``int(n * (1 - R))`` kept), and every row records the fraction its request really removed."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_RECONSTRUCTION, random_prompt

import evalkit.compression as ec
from evalkit.core import budget


def test_the_grammar_reads_a_fraction_removed_beside_factors_and_tokens():
    assert budget.parse("removed_0.75") == ("removed", 0.75) and budget.removed("removed_0.75") == 0.75
    assert budget.removed("4x") is None and budget.removed("tokens_64") is None and budget.removed(None) is None
    assert budget.capacity("removed_0.75", 1000) == 250 and budget.capacity("removed_0", 1000) == 1000
    assert budget.factor("removed_0.75") == 4.0
    with pytest.raises(ValueError, match="removes every token"):
        budget.parse("removed_1")
    with pytest.raises(ValueError, match="'removed_0.75' \\(kvpress' compression_ratio\\)"):
        budget.parse("removed_-0.5")


@pytest.mark.parametrize("method, ratio", [("snapkv", 0.5), ("adakv", 0.75), ("knorm", 0.3), ("kvzip", 0.5)])
def test_each_prompt_keeps_its_own_share(llama, method, ratio):
    settings = {"window": 8} if method in ("snapkv", "adakv") else {}

    def built(budget_):
        policy = ec.policy_from_budget(method, budget_, 1024, **settings)
        return policy.with_prompts(TINY_RECONSTRUCTION) if method == "kvzip" else policy

    policy = built(f"removed_{ratio}")
    for n in (90, 61):
        out = ec.generate(llama, random_prompt(n), policy, max_new_tokens=3)
        kept = out.stats[0]["kept_prompt_tokens"]
        assert sum(kept) / len(kept) == int(n * (1 - ratio)), (method, n)  # AdaKV's and KVzip's: on average
        sized = ec.generate(llama, random_prompt(n), built(f"tokens_{int(n * (1 - ratio))}"), max_new_tokens=3)
        assert torch.equal(out.logits, sized.logits)  # the method sized for this prompt, nothing else


def test_the_engine_sizes_every_request_by_its_prompt(llama):
    policy = ec.policy_from_budget("snapkv", "removed_0.5", 1024, window=8)
    prompts = [random_prompt(n, seed=n)[0] for n in (90, 61, 120)]
    done = ec.Engine(llama, policy, slots=2).run([ec.Request(p, max_new_tokens=4) for p in prompts])
    for completion in done:
        n = prompts[completion.index].numel()
        assert completion.stats["kept_prompt_tokens"] == [n // 2] * llama.config.num_hidden_layers


def test_fixed_size_methods_and_mixed_length_batches_are_refused_in_one_line(llama):
    with pytest.raises(ValueError, match="snapstream keeps a cache of a fixed size: give it Nx or tokens_N"):
        ec.policy_from_budget("snapstream", "removed_0.5", 1024)
    policy = ec.policy_from_budget("snapkv", "removed_0.5", 1024)
    batch = torch.cat([torch.nn.functional.pad(random_prompt(60), (30, 0)), random_prompt(90)])
    mask = torch.cat([torch.nn.functional.pad(torch.ones(1, 60, dtype=torch.long), (30, 0)),
                      torch.ones(1, 90, dtype=torch.long)])
    with pytest.raises(ValueError, match="this batch's prompts differ in length: prefill them one at a time"):
        ec.generate(llama, batch, policy, attention_mask=mask, max_new_tokens=2)
    with pytest.raises(ValueError, match="removing 0.9 of a 20-token prompt keeps 1 of them, too few for snapkv"):
        ec.generate(llama, random_prompt(20), ec.policy_from_budget("snapkv", "removed_0.9", 1024), max_new_tokens=2)


def test_a_run_records_the_fraction_each_sample_removed(tmp_path, random_model_dir):
    from test_harness import composed

    import evalkit.run.runner as runner
    from evalkit.run import validate

    def run(*extra):
        spec = validate(composed(f"model.pretrained={random_model_dir}", "limit=4", "batch_size=2",
                                 "+task.generation.max_gen_toks=4", f"results_dir={tmp_path / 'r'}", *extra),
                        method_explicit=True)
        return runner.run(spec)

    samples = run("method=snapkv", "+budget=removed_0.5").samples
    kept = (samples["prompt_tokens"] // 2).astype(float)
    assert (samples["kept_prompt_tokens"] == kept).all()
    assert samples["compression_ratio"].tolist() == pytest.approx((1 - kept / samples["prompt_tokens"]).tolist())
    assert not samples["over_budget"].any() and (samples["kv_bytes_predicted"] == samples["kv_bytes_peak"]).all()
    import pandas as pd

    written = pd.read_parquet(tmp_path / "r" / "samples")  # the tables carry the budget beside the ratio realized
    assert (written["budget"] == "removed_0.5").all() and written["compression_ratio"].notna().all()
