"""Greedy texts from an OpenAI server for a few fixed chat prompts, to set side by side across
systems serving the same weights (do they agree?)."""

from __future__ import annotations

import httpx

PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three primary colors.",
    "What is 12 times 7?",
)


def greedy_texts(base_url: str, model: str, max_tokens: int = 32, prompts: tuple[str, ...] = PROMPTS) -> list[str]:
    """One chat completion per prompt, temperature 0, one after another (no batching effects)."""
    texts = []
    with httpx.Client(base_url=base_url, timeout=120.0) as client:
        for prompt in prompts:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            reply = client.post("/v1/chat/completions", json=body)
            reply.raise_for_status()
            texts.append(reply.json()["choices"][0]["message"]["content"] or "")
    return texts
