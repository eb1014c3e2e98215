"""lm-eval hooks of the agent_loop task: sessions of calls, each a retrieved document and a question (agent_loop.py)."""

import datasets

from evalkit.tasks.agent_loop import agent_loop
from evalkit.tasks.needle import haystack, needle


def load(path=None, calls=4, n_sessions=2, doc_tokens=200, variant="recall", seed=1234, **_options):
    """The calls of ``path`` (a .jsonl file of calls), else of generated sessions."""
    if path:
        rows, where = agent_loop.read_calls(path), str(path)
    else:
        rows, where = agent_loop.build_calls(int(calls), int(n_sessions), int(doc_tokens), variant, int(seed)), "agent_loop"
    docs = agent_loop.docs_of(agent_loop.sessions_of(rows, where))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def doc_to_text(doc):
    """The call's whole prompt (``task.mode=single``): the preamble, every document so far, the question."""
    return doc["context"] + doc_to_question(doc)


def doc_to_question(doc):
    """What follows the session's shared context (the preamble and the first document) in the call's prompt: the
    later documents so far, then the question."""
    return doc["between"] + doc_to_new_content(doc) + agent_loop.question_part(doc["question"])


def doc_to_new_content(doc):
    """The document this call brings (nothing for the first call, whose document ends the shared context): the text
    a multi_turn follow-up starts with, before its question."""
    return agent_loop.tool_output(doc["turn"], doc["content"]) if doc["turn"] > 1 else ""


def doc_to_follow_up(doc):
    """A later call in a chat: its new document, then its question."""
    return doc_to_new_content(doc) + agent_loop.question_part(doc["question"])


def dataset_identity(dataset_kwargs):
    return f"agent_loop:{haystack.source()}"


def process_results(doc, results):
    return needle.score(doc, results[0])
