"""Every setting of a run, declared once with its kind, range and meaning (:class:`evalkit.core.schema.Key`): the run's
own options, the model's, the task's (its dataset options and rows declared beside its code, in
``tasks/<folder>/schema.py``: :func:`dataset_keys`, :func:`row_keys`), generation, parallel and logger. A method's
settings are declared in its own file (:mod:`.method_schema`). :func:`evalkit.run.spec.precheck` checks a composed
config against all of them before anything loads; tests/test_schema_fuzz.py draws hostile values from them."""

from __future__ import annotations

from functools import cache

from evalkit.core.schema import Key

RUN = {
    "budget": Key("any", "the cache budget: null (full), Nx or tokens_N (its grammar: evalkit.core.budget)"),
    "results_dir": Key("text", "where the tables go"),
    "seed": Key("int", "the run's seed", low=0),
    "limit": Key("int", "evaluate only the first N documents", low=1, nullable=True),
    "batch_size": Key("int", "engine slots decoded together", low=1),
    "compile": Key("any", "true, false or a torch.compile backend (checked by evalkit.compression.compile_backend)"),
    "fidelity_tokens": Key("int", "greedy tokens compared with a full-cache run", low=0),
    "resume": Key("bool", "skip a finished config, continue an interrupted one"),
    "strict_budget": Key("bool", "a request over its budget is an error"),
    "threads": Key("int", "torch CPU threads", low=1, nullable=True),
    "device": Key("text", "auto, cpu, cuda, cuda:N or mps"),
    "verbose": Key("bool", "libraries' logs on the terminal too"),
    "bad_rows": Key("str", "what a malformed data row does", choices=("error", "skip"), says="error or skip"),
    "compression_scope": Key("str", "what compression sees", choices=("prompt", "context"), says="prompt or context"),
    "prefill_chunk": Key("int", "prefill this many tokens at a time", low=1, nullable=True,
                         says="a positive integer of tokens or null"),
    "prefill_chunk_mode": Key("str", "chunked prefill: exact or compress", choices=("exact", "compress")),
    "kv_bits": Key("int", "bits of the stored KV (16: unquantized)", choices=(2, 4, 8, 16), says="2, 4, 8 or 16"),
    "kv_group_size": Key("int", "quantization group", low=1),
    "kv_residual": Key("int", "generated tokens kept at full precision", low=1),
    "memory": Key("mapping", "memory.enforce: a budget that does not fit is an error"),
    "session": Key("mapping", "session.recompress: what a multi_turn session's cache does with a call's new content"),
}
GROUPS = ("model", "method", "task", "hardware", "deployment", "parallel", "logger")  # config groups, declared below

MODEL = {
    "name": Key("text", "the model config's name"),
    "pretrained": Key("text", "hub id, local folder, gguf:FILE or builtin:NAME"),
    "max_context": Key("int", "the evaluation context (tokens); at most the model's positions", low=1),
    "dtype": Key("str", "weights' dtype", choices=("float32", "bfloat16", "float16")),
    "apply_chat_template": Key("bool", "prompts through the tokenizer's chat template"),
    "revision": Key("text", "hub revision", nullable=True),
    "device_map": Key("any", "accelerate's device map (checked by evalkit.run.spec)"),
    "deployment": Key("text", "the deployment priced for this model", nullable=True),
}

MEMORY = {"enforce": Key("bool", "a budget that does not fit the deployment is a config error")}

# What a multi_turn session's compressed cache does with the new content a later call brings (a tool output): never
# (appended, the default), each_call (the whole cache compressed again to the budget), new_content (the new content
# alone compressed to its share). evalkit.compression.recompress runs them.
SESSION = {"recompress": Key("str", "a later call's new content: appended, the cache recompressed, or the content "
                                    "compressed alone", choices=("never", "each_call", "new_content"),
                             says="one of never, each_call, new_content")}

TASK = {
    "name": Key("text", "the task"),
    "source": Key("str", "lm_eval: a task of lm-eval's registry", choices=("lm_eval",), nullable=True),
    "dataset": Key("mapping", "the task's dataset options (declared in tasks/<folder>/schema.py)", nullable=True),
    "generation": Key("mapping", "over the task's generation_kwargs", nullable=True),
    "repeats": Key("int", "samples per prompt", low=1, nullable=True),
    "system_instruction": Key("str", "a system turn", nullable=True),
    "gen_prefix": Key("str", "what the answer starts with", nullable=True),
    "num_fewshot": Key("int", "few-shot examples", low=0, nullable=True),
    "metadata": Key("mapping", "lm-eval task metadata", nullable=True),
    "mode": Key("str", "single | multi_request | multi_turn", choices=("single", "multi_request", "multi_turn"),
                nullable=True, says="one of single, multi_request, multi_turn"),
    "history": Key("str", "multi_turn: what a chat keeps of each answer", choices=("own", "gold"), nullable=True,
                   says="own or gold"),
    "truncation": Key("str", "cut prompts too long for the context (left: keep the end; middle: both ends), counted; "
                             "null: refuse them", choices=("left", "middle"), nullable=True),
}

GENERATION = {
    "max_gen_toks": Key("int", "tokens generated at most", low=1, nullable=True),
    "max_new_tokens": Key("int", "tokens generated at most", low=1, nullable=True),
    "until": Key("any", "stop strings", nullable=True),
    "do_sample": Key("bool", "sample (else greedy)", nullable=True),
    "temperature": Key("float", "sampling temperature", low=0, nullable=True),
    "top_p": Key("float", "nucleus sampling", low=0, high=1, nullable=True),
    "max_len": Key("int", "LongBench's middle truncation of the raw prompt (tokens)", low=1, nullable=True),
    "truncation": Key("str", "the protocol's own truncation", choices=("left", "middle"), nullable=True),
}

PARALLEL = {
    "name": Key("str", "single or ray", choices=("single", "ray")),
    "replicas": Key("int", "engine replicas", low=1),
    "address": Key("str", "a Ray address", nullable=True),
    "cpus_per_replica": Key("int", "CPUs a replica", low=1, nullable=True),
    "gpus_per_replica": Key("float", "GPUs a replica", low=0, nullable=True),
    "max_restarts": Key("int", "restarts of a dead replica", low=0, nullable=True),
}

LOGGER = {
    "name": Key("str", "none, trackio or wandb", choices=("none", "trackio", "wandb")),
    "project": Key("text", "the tracker's project"),
    "dir": Key("text", "the tracker's store", nullable=True),
    "group": Key("text", "the run's group", nullable=True),
}

# What lm-eval's registry tasks take as task.dataset (conf/task/lm_eval.yaml).
REGISTRY_DATASET = {
    "path": Key("text", "hub id, or a datasets builder (json, csv, parquet) with kwargs.data_files", nullable=True),
    "name": Key("text", "the dataset's config name", nullable=True),
    "kwargs": Key("mapping", "load_dataset's keyword arguments", nullable=True),
}


def dataset_keys(task: str) -> dict[str, Key] | None:
    """The dataset options task ``task`` declares (``DATASET`` in its folder's schema.py), or None when it declares
    none (then its options go unchecked: tests refuse a shipped task without one)."""
    return _declared(task, "DATASET")


def row_keys(task: str) -> dict[str, Key] | None:
    """The fields every row (document) of ``task`` holds, as its loader yields them (``ROWS`` in its schema.py)."""
    return _declared(task, "ROWS")


def _declared(task: str, name: str):
    module = _schema_module(task)
    found = getattr(module, name, None) if module is not None else None
    return found(task) if callable(found) else found


@cache
def _schema_module(task: str):
    """``tasks/<folder>/schema.py`` of the first of the task's definition folders that has one (aime25 takes
    aime24's), imported torch-free; None for a task of lm-eval's registry or one without."""
    from evalkit.benchmark import FolderTask
    from evalkit.benchmark import definition as yaml_definition

    task_obj = FolderTask(task)
    if not task_obj.yaml_path.is_file():
        return None
    for folder in yaml_definition.folders(task_obj.yaml_path):
        module = yaml_definition.module(folder, "schema")
        if module is not None:
            return module
    return None
