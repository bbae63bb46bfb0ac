"""How many requests/s this engine serves within the TPOT target: the load a trace is scaled to.

A trace's load only means something next to the machine's capacity: the same day overloads a slow
machine and idles a fast one, and the engine keeps getting faster. `probe_capacity` measures it
in the same run, before the trace: it runs a sample of the trace's busiest mix through a fresh
engine (the engine's default 2048-token step budget), then batches of short prompts at several
sizes and lone prefills (probe_phases: batch size, prefill and context varied apart), fits the
step model to all those steps with non-negative costs and without outliers (ferry.slo.step_fit;
the online recursive fit of a single all-at-once run gave negative overheads, or 16-24 ms ones
that left no cap within the target, on this machine) and finds
the highest arrival rate whose steady state the SLO controller predicts within the TPOT target
at p90: at rate r a step carries the prefill that arrives during it, and the largest cap whose
step then holds the target must serve r (cap / mean output / step >= r). Above that rate no
batch cap holds the target: requests queue or their TPOT breaks. `--peak-load X` puts the
trace's peak at X times that rate.
"""

from __future__ import annotations

import itertools
import time

from ferry.bench.offline_turns import engine_config
from ferry.bench.workload import WorkloadRequest
from ferry.engine.llm_engine import LLMEngine
from ferry.model import LoadedModel
from ferry.protocol import SamplingParams
from ferry.slo import SloController, SloTargets, TokenMix
from ferry.slo.step_fit import fit_steps
from ferry.slo.step_model import StepRecord

PROBE_MAX_NUM_SEQS = 32
PROBE_STEP_TOKENS = 2048
"""The fixed caps' step budget (small chunks made noisier fits: 10x the residual in a trial)."""
PROBE_SHORT_PROMPT = 8
PROBE_SHORT_OUTPUT = 12
PROBE_DECODE_BATCHES = (1, 4, 12, 32)
PROBE_PREFILL_FRACTIONS = (0.125, 0.25, 0.5, 1.0)
_probe_ids = itertools.count()


def probe_capacity(lm: LoadedModel, requests: list[WorkloadRequest], targets: SloTargets, num_kv_blocks: int) -> dict:
    """The SLO capacity (requests/s) for the mix of `requests`, measured on this machine now."""
    if not requests:
        raise ValueError("probe_capacity: no requests to probe with")
    engine = LLMEngine(lm, engine_config("dynamic", PROBE_MAX_NUM_SEQS, num_kv_blocks, PROBE_STEP_TOKENS))
    engine.warmup()
    started = time.perf_counter()
    records = [record for phase in probe_phases(requests) for record in run_phase(engine, phase)]
    fit = fit_steps(records)
    mix = TokenMix(
        sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        sum(r.max_tokens for r in requests) / len(requests),
    )
    controller = SloController(fit.to_model(), targets)
    capacity = max_rate_rps(controller, mix)
    if capacity <= 0:
        floor = controller.decode_plan(mix, True, 0.0).predicted_step_ms
        raise ValueError(
            f"--peak-load: even one request at a time misses TPOT {targets.tpot_ms} ms at p90 for this mix "
            f"on this machine (predicted decode step {floor:.1f} ms; probe fit {fit.snapshot()}): the "
            "load cannot be set relative to a capacity of 0; give --peak-rps (day-night) or "
            "--trace-speedup (replay), or a looser --tpot-slo-ms"
        )
    plan = controller.decode_plan(mix, True, capacity)
    return {
        "capacity_rps": capacity,
        "cap": plan.max_num_seqs,
        "predicted_step_ms": plan.predicted_step_ms,
        "mix": {"mean_prompt_tokens": mix.mean_prompt_tokens, "mean_output_tokens": mix.mean_output_tokens},
        "num_requests": len(requests),
        "probe_s": time.perf_counter() - started,
        "step_model": fit.snapshot(),
    }


def probe_phases(requests: list[WorkloadRequest]) -> list[list[tuple[list[int], int]]]:
    """What the probe runs, phase after phase, as (prompt, output tokens): steps whose batch size,
    prefill and context vary apart, so that the fit can tell their costs apart (all of one mix at
    once makes them grow and shrink together):
    1. the mix all at once (prefill steps of several prompts, then a shrinking batch of decodes
       whose context is the mix's);
    2. batches of PROBE_DECODE_BATCHES short prompts, decoding with almost no context;
    3. one prompt alone at PROBE_PREFILL_FRACTIONS of the longest prompt: prefill without decodes."""
    longest = max(requests, key=lambda r: len(r.prompt_token_ids)).prompt_token_ids
    short = [r.prompt_token_ids[:PROBE_SHORT_PROMPT] for r in requests]
    decode_batches = [[(short[i % len(short)], PROBE_SHORT_OUTPUT) for i in range(b)] for b in PROBE_DECODE_BATCHES]
    lone_prefills = [[(longest[: max(int(len(longest) * f), 1)], 1)] for f in PROBE_PREFILL_FRACTIONS]
    return [[(r.prompt_token_ids, r.max_tokens) for r in requests], *decode_batches, *lone_prefills]


def run_phase(engine: LLMEngine, phase: list[tuple[list[int], int]]) -> list[StepRecord]:
    """Runs one phase's requests to the end together; the steps it took."""
    for prompt, max_tokens in phase:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(f"probe-{next(_probe_ids)}", list(prompt), params)
    records = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not None:
            records.append(engine.last_step)
    return records


def max_rate_rps(controller: SloController, mix: TokenMix, rel_tol: float = 1e-3) -> float:
    """The highest arrival rate of this mix whose steady state holds the TPOT target (module doc);
    0 when not even a trickle does. The cap's capacity falls as the rate's prefill grows, so the
    rates that fit are an interval from 0: doubling, then bisection."""

    def fits(rate: float) -> bool:
        plan = controller.decode_plan(mix, True, rate)
        return plan.is_feasible and plan.capacity_rps >= rate

    lo, hi = 0.0, 0.01
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return lo  # a model with no cost per token: nothing bounds the rate
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def peak_window_rps(arrivals: list[float], window_s: float) -> float:
    """The most arrivals in any window_s-long stretch (starting at an arrival), per second."""
    if window_s <= 0:
        raise ValueError(f"peak_window_rps: window_s={window_s} must be > 0")
    most, lo = 0, 0
    for hi, t in enumerate(arrivals):
        while arrivals[lo] < t - window_s:
            lo += 1
        most = max(most, hi - lo + 1)
    return most / window_s
