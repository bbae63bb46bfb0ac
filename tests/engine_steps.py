"""Driving an in-process engine to the end in tests."""

from ferry.engine import LLMEngine


def run_to_end(eng: LLMEngine, request_id: str) -> list[int]:
    """Step `eng` until nothing is left; the new tokens of `request_id`, in order."""
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens
