"""Official prompts, answer extraction and scoring of the benchmark tasks in tasks/ (their utils.py call these)."""


def keep_all_samples(responses, docs):
    """lm-eval filter that hands every sample of a prompt to process_results (its default keeps only the first)."""
    return responses


def all_responses(results: list) -> list[str]:
    """The responses lm-eval passes to process_results: flat, or nested one level deep by the filter above."""
    return [text for item in results for text in (item if isinstance(item, list) else [item])]
