"""The systems under test of `ferry bench --offline`, as turn-taking iterators on their own clocks.

A system is an iterator: each next() does one unit of work (an engine step, a `generate` call)
and yields how many requests finished in it. side_by_side lets the systems take turns, so load
from other processes on a shared machine hits them alike. Each system keeps its own clock, which
advances by the measured duration of its own work and jumps over idle gaps to the next arrival.

Engine systems: 'dynamic' (iteration-level batching), 'static' (compacting: a batch runs to its
end, a finished member leaves the compute at once) and 'static_padded' (classic static batching
on dense [batch, length] tensors, as FasterTransformer-era servers and HF generate do it: when the
server is idle, the arrived requests form a batch; every prompt is left-padded to the batch's
longest prompt and every member generates the batch's longest output; nobody joins until it is
done; no prefix cache). Padded tokens are really computed (the pad positions are attended here,
where a dense server masks them: the same matmul work) but not counted as output.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ferry.bench.workload import WorkloadRequest, latency_summary
from ferry.engine.adaptive import AdaptiveLimits
from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import LoadedModel
from ferry.protocol import SamplingParams

ENGINE_SYSTEMS = ("dynamic", "static", "static_padded")


@dataclass(slots=True)
class RunResult:
    """One system on one arrival schedule; times on the system's own clock (see module doc)."""

    system: str
    rate_rps: float
    busy_s: float = 0.0
    """The system's clock at the end: its own work plus idle gaps waiting for arrivals."""
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    request_indices: list[int] = field(default_factory=list)
    """The workload index of each e2e_s / ttft_s entry (requests in the order they finished)."""
    engine_stats: dict | None = None
    static_batches: list[list[int]] = field(default_factory=list)
    """static_padded: the request indices of each batch, in the order they ran."""

    def summary(self) -> dict:
        n = len(self.e2e_s)
        out = {
            "system": self.system,
            "offered_rps": None if math.isinf(self.rate_rps) else self.rate_rps,
            "num_requests": n,
            "busy_s": self.busy_s,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens / self.busy_s,
            "requests_per_s": n / self.busy_s,
            "ttft_ms": latency_summary(self.ttft_s),
            "tpot_ms": latency_summary(self.tpot_s),
            "e2e_ms": latency_summary(self.e2e_s),
            "engine": self.engine_stats,
        }
        if self.static_batches:
            out["num_static_batches"] = len(self.static_batches)
            out["mean_static_batch_size"] = n / len(self.static_batches)
        return out


Turns = Generator[int, None, "RunResult"]
"""A system under test: each next() does one unit of work and yields how many requests finished
in it; its return value is the RunResult."""


def side_by_side(systems: dict[str, Turns], total: int, progress: bool) -> dict[str, RunResult]:
    """Let the systems take turns, one unit of work each, until all are done."""
    from tqdm import tqdm

    results: dict[str, RunResult] = {}
    active = dict(systems)
    with tqdm(total=total, desc="bench", unit="req", disable=not progress) as bar:
        while active:
            for name, turns in list(active.items()):
                try:
                    bar.update(next(turns))
                except StopIteration as done:
                    results[name] = done.value
                    del active[name]
    return results


# ---- the engine ----------------------------------------------------------------------------------
def engine_config(
    system: str, max_num_seqs: int, num_kv_blocks: int, max_num_batched_tokens: int = 2048, device: str = "cpu"
) -> EngineConfig:
    """The engine settings of one system: both static variants run the engine's static scheduler
    (padding is how engine_turns admits and sizes static_padded's requests); token ids out, no
    detokenizing (the workload's prompts are random ids)."""
    if system not in ENGINE_SYSTEMS:
        raise ValueError(f"system={system!r}: choose from {ENGINE_SYSTEMS}")
    return EngineConfig(
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        batching="static" if system == "static_padded" else system,
        detokenize=False,
        enable_prefix_caching=system != "static_padded",  # dense static servers have none
        device=device,
    )


def engine_turns(
    lm: LoadedModel,
    config: EngineConfig,
    requests: list[WorkloadRequest],
    arrivals: list[float],
    name: str,
    adaptive: AdaptiveLimits | None = None,
) -> Turns:
    """The engine as a system: an arrived request is handed to it at once ('dynamic', 'static': the
    engine queues it), or, for 'static_padded', held until the engine is idle and then admitted
    with the others that arrived as one padded batch (static_batch). With `adaptive`, the SLO
    controller sets the cap and chunk budget before every step (its work is on the clock)."""
    engine = LLMEngine(lm, config)
    engine.warmup()  # as a worker does before it takes work: no kernel build or graph capture in the timing
    _warm_up(engine)
    before = engine.stats()
    wanted = {r.index: r.max_tokens for r in requests}
    result = RunResult(name, _rate(arrivals), output_tokens=sum(wanted.values()))
    order = deque(sorted(range(len(requests)), key=lambda i: arrivals[i]))
    arrived: deque[WorkloadRequest] = deque()
    first_s: dict[int, float] = {}
    clock = 0.0
    while order or arrived or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and not arrived and arrivals[order[0]] > clock:
            clock = arrivals[order[0]]  # idle until the next arrival
        started = time.perf_counter()
        while order and arrivals[order[0]] <= clock:
            arrived.append(requests[order.popleft()])
        for req in _to_submit(name, engine, arrived, result):
            engine.add_request(str(req.index), req.prompt_token_ids, _sampling(req), arrival_time=arrivals[req.index])
            if adaptive is not None:
                adaptive.observe_arrival(arrivals[req.index], len(req.prompt_token_ids), req.max_tokens)
        if adaptive is not None:
            adaptive.before_step(engine, clock)
        outputs = engine.step()
        if adaptive is not None:
            adaptive.after_step(engine)
        clock += time.perf_counter() - started
        yield _record(outputs, clock, arrivals, first_s, result, wanted)
    result.busy_s = clock
    result.engine_stats = _engine_stats(before, engine.stats(), requests)
    return result


def _to_submit(
    name: str, engine: LLMEngine, arrived: deque[WorkloadRequest], result: RunResult
) -> list[WorkloadRequest]:
    if name != "static_padded":
        submit = list(arrived)
        arrived.clear()
        return submit
    if engine.has_unfinished_requests() or not arrived:
        return []
    batch = static_batch(list(arrived), engine.config)
    for _ in batch:
        arrived.popleft()
    result.static_batches.append([r.index for r in batch])
    return batch


PAD_TOKEN_ID = 0
"""What static_padded left-pads prompts with (its value does not change the cost)."""


def static_batch(waiting: list[WorkloadRequest], config: EngineConfig) -> list[WorkloadRequest]:
    """The next batch of a classic static server from its waiting queue (arrival order): the
    first requests, up to max_num_seqs, whose dense padded shape (the batch's longest prompt +
    its longest output, for every member) fits the KV pool; each prompt left-padded to that
    longest prompt, each member made to generate that longest output. First come, first served:
    the batch stops at the first request that does not fit."""
    blocks = config.num_kv_blocks or 0
    taken, prompt_len, longest = 0, 0, 0
    for req in waiting[: config.max_num_seqs]:
        new_prompt, new_longest = max(prompt_len, len(req.prompt_token_ids)), max(longest, req.max_tokens)
        if (taken + 1) * _blocks(new_prompt + new_longest, config) > blocks:
            break
        taken, prompt_len, longest = taken + 1, new_prompt, new_longest
    if taken == 0:
        need = _blocks(len(waiting[0].prompt_token_ids) + waiting[0].max_tokens, config)
        raise ValueError(f"static_padded: request {waiting[0].index} needs {need} KV blocks > num_kv_blocks={blocks}")
    return [
        replace(
            r,
            max_tokens=longest,
            prompt_token_ids=[PAD_TOKEN_ID] * (prompt_len - len(r.prompt_token_ids)) + list(r.prompt_token_ids),
        )
        for r in waiting[:taken]
    ]


def _blocks(num_tokens: int, config: EngineConfig) -> int:
    return -(-num_tokens // config.block_size)


def _record(
    outputs, clock: float, arrivals: list[float], first_s: dict[int, float], result: RunResult, wanted: dict[int, int]
) -> int:
    finished = 0
    for out in outputs:
        i = int(out.request_id)
        first_s.setdefault(i, clock)
        if out.finish_reason is not None:
            num_out = min(out.index + len(out.new_token_ids), wanted[i])  # padded tokens are not output
            result.request_indices.append(i)
            result.ttft_s.append(first_s[i] - arrivals[i])
            result.e2e_s.append(clock - arrivals[i])
            if num_out > 1:
                result.tpot_s.append((clock - first_s[i]) / (num_out - 1))
            finished += 1
    return finished


def _engine_stats(before, after, requests: list[WorkloadRequest]) -> dict:
    steps = after.num_steps - before.num_steps
    scheduled = after.mean_batch_size * after.num_steps - before.mean_batch_size * before.num_steps
    cached = after.num_cached_tokens - before.num_cached_tokens
    return {
        "num_computed_tokens": after.num_computed_tokens - before.num_computed_tokens,
        "num_cached_tokens": cached,
        "kv_hit_rate": cached / sum(len(r.prompt_token_ids) for r in requests),
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "num_steps": steps,
        "mean_batch_size": scheduled / max(steps, 1),
        "kv_blocks_total": after.kv_blocks_total,
    }


def _sampling(req: WorkloadRequest) -> SamplingParams:
    return SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True)


def _warm_up(engine: LLMEngine) -> None:
    engine.add_request("warmup", list(range(16, 48)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _rate(arrivals: list[float]) -> float:
    return math.inf if all(a == 0 for a in arrivals) else (len(arrivals) - 1) / max(arrivals[-1], 1e-9)


# ---- transformers ------------------------------------------------------------------------------
def transformers_turns(model_dir: Path, requests: list[WorkloadRequest], batch_size: int) -> Turns:
    """Hugging Face `generate` in static batches (left-padded), greedy, exact output lengths."""
    from transformers import AutoModelForCausalLM

    from ferry.model.source import transformers_location

    folder, kwargs = transformers_location(model_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    _hf_batch(model, requests[:1], pad, warm_up=True)
    result = RunResult("transformers", math.inf, output_tokens=sum(r.max_tokens for r in requests))
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        started = time.perf_counter()
        _hf_batch(model, batch, pad)
        result.busy_s += time.perf_counter() - started
        result.e2e_s += [result.busy_s] * len(batch)
        result.request_indices += [r.index for r in batch]
        yield len(batch)
    return result


def _hf_batch(model, batch: list[WorkloadRequest], pad: int, warm_up: bool = False) -> None:
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.int64)  # [B, S] left-padded
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, req in enumerate(batch):
        ids[row, width - len(req.prompt_token_ids) :] = torch.tensor(req.prompt_token_ids)
        mask[row, width - len(req.prompt_token_ids) :] = 1
    new = 4 if warm_up else max(r.max_tokens for r in batch)  # rows that want fewer still run: static
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
        )
