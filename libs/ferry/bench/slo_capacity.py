"""How many requests/s this engine serves within the TPOT target: the load a trace is scaled to.

A trace's load only means something next to the machine's capacity: the same day overloads a slow
machine and idles a fast one, and the engine keeps getting faster. `probe_capacity` measures it
in the same run, before the trace: it runs a sample of the trace's busiest mix through a fresh
engine (all at once, the engine's default 2048-token step budget: prefill steps of several
prompts, then decode steps of a shrinking batch), fits a StepTimeModel to those steps and finds
the highest arrival rate whose steady state the SLO controller predicts within the TPOT target
at p90: at rate r a step carries the prefill that arrives during it, and the largest cap whose
step then holds the target must serve r (cap / mean output / step >= r). Above that rate no
batch cap holds the target: requests queue or their TPOT breaks. `--peak-load X` puts the
trace's peak at X times that rate.
"""

from __future__ import annotations

import time

from ferry.bench.offline_turns import engine_config
from ferry.bench.workload import WorkloadRequest
from ferry.engine.llm_engine import LLMEngine
from ferry.model import LoadedModel
from ferry.protocol import SamplingParams
from ferry.slo import SloController, SloTargets, StepTimeModel, TokenMix

PROBE_MAX_NUM_SEQS = 32
PROBE_STEP_TOKENS = 2048
"""The fixed caps' step budget (small chunks made noisier fits: 10x the residual in a trial)."""


def probe_capacity(lm: LoadedModel, requests: list[WorkloadRequest], targets: SloTargets, num_kv_blocks: int) -> dict:
    """The SLO capacity (requests/s) for the mix of `requests`, measured on this machine now."""
    if not requests:
        raise ValueError("probe_capacity: no requests to probe with")
    model = StepTimeModel(forgetting=1.0)  # one short fit: nothing to forget
    engine = LLMEngine(lm, engine_config("dynamic", PROBE_MAX_NUM_SEQS, num_kv_blocks, PROBE_STEP_TOKENS))
    engine.warmup()
    started = time.perf_counter()
    for req in requests:
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(f"probe-{req.index}", req.prompt_token_ids, params)
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not None:
            model.observe(engine.last_step)
    mix = TokenMix(
        sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        sum(r.max_tokens for r in requests) / len(requests),
    )
    controller = SloController(model, targets)
    capacity = max_rate_rps(controller, mix)
    if capacity <= 0:
        raise ValueError(
            f"--peak-load: no batch cap holds TPOT {targets.tpot_ms} ms for this mix on this machine "
            f"(probe step model {model.snapshot()['coefficients_ms']}): give --peak-rps instead"
        )
    plan = controller.decode_plan(mix, True, capacity)
    return {
        "capacity_rps": capacity,
        "cap": plan.max_num_seqs,
        "predicted_step_ms": plan.predicted_step_ms,
        "mix": {"mean_prompt_tokens": mix.mean_prompt_tokens, "mean_output_tokens": mix.mean_output_tokens},
        "num_requests": len(requests),
        "probe_s": time.perf_counter() - started,
        "step_model": model.snapshot(),
    }


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
