"""One streaming /v1/completions call against any OpenAI-compatible server, timed token by token.

`stream_completion` sends one request, reads the SSE stream and stamps every content chunk with the
monotonic clock as its bytes arrive, so TTFT and inter-token gaps are measured where a user would
see them. Output tokens are counted from the final `usage` (asked for with
`stream_options.include_usage`) when the server reports it, else from the content chunks.

How a server is told to produce exactly `max_tokens` tokens (random weights would otherwise stop
at an early EOS) differs per server, hence `length_control`:
  - "extra": vLLM-style extra body fields `ignore_eos` + `min_tokens` (ferry's gateway, vLLM, SGLang);
  - "hf-generation-config": `transformers serve` rejects unknown fields with 422 but takes a
    `generation_config` JSON string, so `min_new_tokens`/`max_new_tokens` go there;
  - "none": plain OpenAI body; the server may stop early (counted tokens still tell the truth).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

LENGTH_CONTROLS = ("extra", "hf-generation-config", "none")


@dataclass(slots=True)
class CompletionCall:
    """What to send: one request of the workload."""

    index: int
    """Position in the workload (stable across systems, so results can be paired)."""
    prompt: str | list[int]
    """Text, or token ids (OpenAI allows a list of ints; ferry's gateway and vLLM accept it)."""
    max_tokens: int
    """Output length the workload asks for."""
    num_prompt_tokens: int
    """Prompt length the workload asked for (the server's `usage` may differ for text prompts)."""


@dataclass(slots=True)
class CallResult:
    """What came back, with times in seconds relative to when the request was sent."""

    index: int
    sent_at_s: float
    """Send time relative to the start of the bench phase."""
    ok: bool = False
    error: str | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    """Arrival of each content chunk, relative to `sent_at_s`."""
    e2e_s: float | None = None
    """Send to end of stream."""
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    """From the server's `usage` when given, else the workload's."""
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (the decode rate one user sees)."""
        if len(self.chunk_times_s) < 2 or self.num_output_tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.num_output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive content chunks."""
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]


def build_body(call: CompletionCall, model: str, length_control: str) -> dict:
    """The JSON body of one streaming completion request."""
    if length_control not in LENGTH_CONTROLS:
        raise ValueError(f"length_control={length_control!r}: must be one of {LENGTH_CONTROLS}")
    body: dict = {
        "model": model,
        "prompt": call.prompt,
        "max_tokens": call.max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    if length_control == "extra":
        body.update(ignore_eos=True, min_tokens=call.max_tokens, stream_options={"include_usage": True})
    elif length_control == "hf-generation-config":
        # transformers serve always reports usage in its last chunk and warns on stream_options.
        body["generation_config"] = json.dumps(
            {"max_new_tokens": call.max_tokens, "min_new_tokens": call.max_tokens, "do_sample": False}
        )
    else:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    call: CompletionCall,
    sent_at_s: float,
    timeout_s: float,
    on_event: Callable[[dict], None] | None = None,
) -> CallResult:
    """POST `body` to `url` (the full /v1/completions URL) and time its stream; never raises for
    server or network errors, which land in `CallResult.error`. `on_event` sees every parsed SSE event."""
    result = CallResult(index=call.index, sent_at_s=sent_at_s)
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {text}"
                return result
            await _read_events(response, result, start, on_event)
    except (httpx.HTTPError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    except ValueError as exc:  # a data line that is not JSON
        result.error = f"bad SSE payload: {exc}"
        return result
    result.e2e_s = time.perf_counter() - start
    if result.num_output_tokens == 0:
        result.num_output_tokens = len(result.chunk_times_s)
    if result.num_prompt_tokens is None:
        result.num_prompt_tokens = call.num_prompt_tokens
    # A server may generate tokens whose text is empty (special tokens it skips) and so stream no
    # chunk at all: the request still succeeded (usage counts its tokens), it just has no TTFT.
    if result.error is None and result.num_output_tokens == 0:
        result.error = "stream ended without any token"
    elif result.error is None and result.finish_reason is None:
        result.error = f"stream cut after {result.num_output_tokens} tokens (no finish_reason)"
    result.ok = result.error is None
    return result


async def _read_events(response: httpx.Response, result: CallResult, start: float, on_event=None) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        now = time.perf_counter() - start
        event = json.loads(payload)
        _apply_event(event, now, result)
        if on_event is not None:
            on_event(event)


def _apply_event(event: dict, now_s: float, result: CallResult) -> None:
    """Fold one SSE event into `result`."""
    if "error" in event:
        err = event["error"]
        result.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
        return
    usage = event.get("usage")
    if usage:
        result.num_output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens") is not None:
            result.num_prompt_tokens = int(usage["prompt_tokens"])
    for choice in event.get("choices") or []:
        text = choice.get("text") or ""
        finish = choice.get("finish_reason")
        # A closing chunk with no text carries no token; a chunk with an empty delta but no
        # finish_reason is a token whose text the detokenizer holds back (partial UTF-8).
        if text or finish is None:
            result.chunk_times_s.append(now_s)
        if finish is not None:
            result.finish_reason = finish


async def scrape_gauge(client: httpx.AsyncClient, url: str, selector: str, timeout_s: float) -> float | None:
    """The value of `selector` at a Prometheus endpoint, or None (absent, unreachable, unparsable)."""
    try:
        response = await client.get(url, timeout=timeout_s)
        return gauge_sum(response.text, selector)
    except (httpx.HTTPError, ValueError):
        return None  # metrics are optional context; a missed sample must not fail the bench


def parse_selector(selector: str) -> tuple[str, dict[str, str]]:
    """'name{a="x",b="y"}' -> ('name', {'a': 'x', 'b': 'y'}); exact matches only."""
    name, _, rest = selector.partition("{")
    labels = {}
    for part in filter(None, (p.strip() for p in rest.rstrip("}").split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f'batch metric selector {selector!r}: label {part!r} is not key="value"')
        labels[key.strip()] = value.strip().strip('"')
    return name.strip(), labels


def gauge_sum(text: str, selector: str) -> float | None:
    """Sum of the samples matching `selector` in a Prometheus text exposition; None if none match."""
    from prometheus_client.parser import text_string_to_metric_families

    name, labels = parse_selector(selector)
    values = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return float(sum(values)) if values else None
