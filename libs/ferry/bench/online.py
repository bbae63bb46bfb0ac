"""Drive an OpenAI-compatible server with a timed workload: one phase = one arrival schedule.

`run_phase` releases each call at its scheduled arrival time (all at once, or a Poisson process),
keeps at most `max_concurrency` requests in flight, and stops the phase after `phase_time_limit_s`
(calls still running then are cancelled and reported as errors, never silently dropped). When the
server exposes Prometheus metrics, a poller samples the running batch size while the phase runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ferry.bench.http_client import (
    LENGTH_CONTROLS,
    CallResult,
    CompletionCall,
    build_body,
    scrape_gauge,
    stream_completion,
)
from ferry.bench.workload import WorkloadConfig, make_workload, poisson_arrivals

PROMPT_FORMATS = ("ids", "text")


@dataclass(slots=True)
class OnlineConfig:
    """How to talk to the server under test."""

    base_url: str
    """Server root, e.g. http://127.0.0.1:8000 (the client appends /v1/completions)."""
    model: str
    """`model` field of every request."""
    max_concurrency: int = 64
    """Most requests in flight at once; later arrivals wait for a free slot (latencies count from the
    send, so that client-side wait is not in them; `PhaseResult.scheduled_s` keeps the arrivals)."""
    request_timeout_s: float = 300.0
    """httpx timeout of one request (connect, and each read of the stream)."""
    phase_time_limit_s: float = 600.0
    """Wall-clock cap of one phase; unfinished calls become errors."""
    length_control: str = "extra"
    """How the server is told to produce exactly max_tokens (see http_client)."""
    metrics_urls: tuple[str, ...] = ()
    """Prometheus text endpoints (e.g. one per worker) to sample the running batch size from; () = off."""
    batch_metric: str = 'ferry_requests_running{role="decode"}'
    """Gauge, with an optional exact-match label selector, summed over label sets and endpoints."""
    metrics_interval_s: float = 0.5
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"OnlineConfig.base_url={self.base_url!r}: must start with http:// or https://")
        if self.max_concurrency < 1:
            raise ValueError(f"OnlineConfig.max_concurrency={self.max_concurrency}: must be >= 1")
        for name in ("request_timeout_s", "phase_time_limit_s", "metrics_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"OnlineConfig.{name}={getattr(self, name)!r}: must be > 0")
        if self.length_control not in LENGTH_CONTROLS:
            raise ValueError(f"OnlineConfig.length_control={self.length_control!r}: must be one of {LENGTH_CONTROLS}")

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/completions"


@dataclass(slots=True)
class PhaseResult:
    """Everything one phase measured."""

    name: str
    rate_rps: float
    """Offered load in requests/s; math.inf = all requests at t=0 (offline throughput)."""
    duration_s: float
    """Phase start (the first arrival) to the last completion, or to the time limit."""
    results: list[CallResult]
    """One per call, in workload order."""
    scheduled_s: list[float]
    """Scheduled arrival of each call, relative to the phase start."""
    batch_samples: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since phase start, running batch size) from the server's metrics."""
    timed_out: bool = False


async def run_phase(
    calls: list[CompletionCall], arrivals_s: list[float], config: OnlineConfig, name: str, rate_rps: float
) -> PhaseResult:
    """Send `calls[i]` at `arrivals_s[i]` seconds after the phase starts; wait for all of them."""
    if len(calls) != len(arrivals_s):
        raise ValueError(f"{len(calls)} calls but {len(arrivals_s)} arrival times")
    limits = httpx.Limits(max_connections=config.max_concurrency + 2, max_keepalive_connections=config.max_concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        gate = asyncio.Semaphore(config.max_concurrency)
        start = time.perf_counter()
        progress = _progress(len(calls), name, config.show_progress)
        tasks = [
            asyncio.create_task(_one_call(client, gate, call, at, start, config)) for call, at in zip(calls, arrivals_s)
        ]
        for task in tasks:
            task.add_done_callback(lambda _t: progress.update(1))
        sampler = _BatchSampler(client, config, start)
        _, pending = await asyncio.wait(tasks, timeout=config.phase_time_limit_s)
        duration_s = time.perf_counter() - start
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        samples = await sampler.stop()
        progress.close()
    results = [_result_of(task, call) for task, call in zip(tasks, calls)]
    if not pending:
        duration_s = max((r.sent_at_s + (r.e2e_s or 0.0) for r in results), default=0.0)
    return PhaseResult(
        name=name,
        rate_rps=rate_rps,
        duration_s=duration_s,
        results=results,
        scheduled_s=list(arrivals_s),
        batch_samples=samples,
        timed_out=bool(pending),
    )


async def _one_call(
    client: httpx.AsyncClient,
    gate: asyncio.Semaphore,
    call: CompletionCall,
    at_s: float,
    start: float,
    config: OnlineConfig,
) -> CallResult:
    delay = at_s - (time.perf_counter() - start)
    if delay > 0:
        await asyncio.sleep(delay)
    async with gate:
        body = build_body(call, config.model, config.length_control)
        sent_at_s = time.perf_counter() - start
        return await stream_completion(client, config.completions_url, body, call, sent_at_s, config.request_timeout_s)


def _result_of(task: asyncio.Task, call: CompletionCall) -> CallResult:
    if task.cancelled():
        return CallResult(index=call.index, sent_at_s=math.nan, error="not finished within the phase time limit")
    if task.exception() is not None:
        exc = task.exception()
        return CallResult(index=call.index, sent_at_s=math.nan, error=f"{type(exc).__name__}: {exc}")
    return task.result()


def _progress(total: int, name: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="req", disable=not enabled, leave=False)


class _BatchSampler:
    """Samples the server's running batch size every `metrics_interval_s` while a phase runs."""

    def __init__(self, client: httpx.AsyncClient, config: OnlineConfig, start: float) -> None:
        self.samples: list[tuple[float, float]] = []
        self._task = asyncio.create_task(self._loop(client, config, start)) if config.metrics_urls else None

    async def _loop(self, client: httpx.AsyncClient, config: OnlineConfig, start: float) -> None:
        timeout_s = config.metrics_interval_s * 4
        while True:
            values = await asyncio.gather(
                *(scrape_gauge(client, url, config.batch_metric, timeout_s) for url in config.metrics_urls)
            )
            found = [v for v in values if v is not None]
            if found:  # one sum over every endpoint (e.g. one per decode worker)
                self.samples.append((time.perf_counter() - start, float(sum(found))))
            await asyncio.sleep(config.metrics_interval_s)

    async def stop(self) -> list[tuple[float, float]]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return self.samples


# Words that are one token each in `ferry make-model`'s tokenizer (and in common BPE vocabularies
# with a leading space), so a text prompt of n-1 words is n tokens there, BOS included.
PROMPT_WORDS = tuple(
    (
        "the a an of to in is was for on that with as by at from it this be are or not have has had ferry "
        "river boat harbor dock wind water light morning evening night day week year time people model "
        "token cache block layer attention query key value server request stream batch prefill decode "
        "gateway worker balancer redis nats message latency throughput memory compute matrix one two three "
        "four five six seven eight nine ten first second last next red green blue small large long short"
    ).split()
)


def ids_to_text(token_ids: list[int]) -> str:
    """A text prompt with one word per token id, so equal id prefixes stay equal text prefixes
    (prefix caching still sees the shared system prompt) and lengths carry over."""
    return "".join(" " + PROMPT_WORDS[t % len(PROMPT_WORDS)] for t in token_ids[1:]).lstrip()


@dataclass(slots=True)
class PhasePlan:
    """One arrival schedule to run the whole workload under."""

    name: str
    rate_rps: float
    """Offered requests/s; math.inf sends everything at t=0."""
    arrivals_s: list[float]


async def run_phases(calls: list[CompletionCall], plans: list[PhasePlan], config: OnlineConfig) -> list[PhaseResult]:
    """Run the phases one after another (each starts on an idle server)."""
    return [await run_phase(calls, plan.arrivals_s, config, plan.name, plan.rate_rps) for plan in plans]


def detect_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id the server lists at /v1/models (servers pinned to one model list it)."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout_s)
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"--url {base_url}: cannot list models at /v1/models ({exc}); pass --served-model") from None
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def parse_rates(text: str) -> list[float]:
    """'inf,1,2.5' -> [inf, 1.0, 2.5]: offered loads in requests/s, inf = all at once."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--rates {text!r}: expected comma-separated numbers or inf") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates {text!r}: need at least one rate, each > 0 (or inf)")
    return rates


def make_calls(workload: WorkloadConfig, prompt_format: str) -> list[CompletionCall]:
    """The workload as HTTP calls: token ids as they are, or one word per id (`ids_to_text`)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format={prompt_format!r}: must be one of {PROMPT_FORMATS}")
    return [
        CompletionCall(
            index=r.index,
            max_tokens=r.max_tokens,
            num_prompt_tokens=len(r.prompt_token_ids),
            prompt=r.prompt_token_ids if prompt_format == "ids" else ids_to_text(r.prompt_token_ids),
        )
        for r in make_workload(workload)
    ]


def make_plans(rates: list[float], num_requests: int, seed: int) -> list[PhasePlan]:
    return [
        PhasePlan(
            "all-at-once" if math.isinf(rate) else f"poisson-{rate:g}rps",
            rate,
            poisson_arrivals(num_requests, rate, seed),
        )
        for rate in rates
    ]


def bench_url(
    config: OnlineConfig,
    workload: WorkloadConfig,
    rates: list[float],
    prompt_format: str,
    out_dir: str,
    meta: dict | None = None,
    plots: bool = True,
) -> dict:
    """The whole `ferry bench --url` run: every phase, then bench.json, PNGs and summary.md in out_dir."""
    from ferry.bench.report import write_report

    calls = make_calls(workload, prompt_format)
    phases = asyncio.run(run_phases(calls, make_plans(rates, workload.num_requests, workload.seed), config))
    meta = {
        "target": config.base_url,
        "model": config.model,
        "num_requests": workload.num_requests,
        "seed": workload.seed,
        "workload": _workload_label(workload),
        "prompt_format": prompt_format,
        "max_concurrency": config.max_concurrency,
        "length_control": config.length_control,
        "rates_rps": [None if math.isinf(r) else r for r in rates],
        **(meta or {}),
    }
    return write_report(out_dir, meta, phases, plots=plots)


def _workload_label(workload: WorkloadConfig) -> str:
    shared = f", shared prefix {workload.shared_prefix_len} tokens" if workload.shared_prefix_len else ""
    return f"BENCHMARKS.md (prompt median {workload.prompt_len_median}, outputs {list(workload.output_lens)}{shared})"


def add_url_arguments(parser) -> None:
    """The options only `ferry bench --url` has (the workload options are shared with the offline bench)."""
    g = parser.add_argument_group("online bench of an OpenAI-compatible server (--url)")
    g.add_argument("--url", help="server root, e.g. http://127.0.0.1:8000 (ferry up, vLLM, transformers serve)")
    g.add_argument("--served-model", help="`model` field of the requests (default: the first of /v1/models)")
    g.add_argument(
        "--rates", default="inf,1,2,4", help="offered loads in req/s, inf = all at once (default %(default)s)"
    )
    g.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most (default %(default)s)")
    g.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds per request read (default %(default)s)"
    )
    g.add_argument(
        "--phase-time-limit", type=float, default=600.0, help="seconds per phase at most (default %(default)s)"
    )
    g.add_argument(
        "--length-control",
        choices=LENGTH_CONTROLS,
        help="how to ask for exact output lengths: extra = ignore_eos/min_tokens (ferry, vLLM); "
        "hf-generation-config = transformers serve; none",
    )
    g.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default="ids",
        help="token ids as the prompt, or one word per id (for servers that take text only)",
    )
    g.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="Prometheus endpoint to sample the batch size from (repeat for several workers)",
    )
    g.add_argument("--batch-metric", default='ferry_requests_running{role="decode"}')


def run_url(args, workload: WorkloadConfig, out_dir: str, show_progress: bool = True) -> int:
    """`ferry bench --url`: cli.py builds the shared workload and output folder, this does the rest."""
    rates = parse_rates(args.rates)  # bad options fail before any network call
    model = args.served_model or detect_model(args.url)
    config = OnlineConfig(
        base_url=args.url,
        model=model,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout,
        phase_time_limit_s=args.phase_time_limit,
        length_control=args.length_control,
        metrics_urls=tuple(args.metrics_url),
        batch_metric=args.batch_metric,
        show_progress=show_progress,
    )
    report = bench_url(config, workload, rates, args.prompt_format, out_dir)
    print((Path(out_dir) / "summary.md").read_text())
    return 0 if all(s["num_errors"] == 0 for s in report["summary"]) else 1
