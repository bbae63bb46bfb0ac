"""The in-process systems of the comparison: ferry's engine under three batching modes.

  engine-static-padded  classic static batching: dense padded batches (prompts to the longest prompt),
                        run until the longest member is done (ferry.bench.offline_turns 'static_padded')
  engine-static         static batching that drops finished sequences from compute ('static')
  engine-dynamic        continuous batching ('dynamic')

They take turns step by step (ferry.bench.offline_turns.side_by_side), so machine noise hits them
alike; each is timed by its own step clock. Everything this harness uses of `ferry bench --offline`'s
code lives in this file: a mode it cannot run on some arrival schedule (it raises ValueError)
becomes a recorded problem for that system and phase, and the others still run.
"""

from __future__ import annotations

ENGINE_SYSTEMS = {"engine-static-padded": "static_padded", "engine-static": "static", "engine-dynamic": "dynamic"}
"""Comparison name -> ferry.bench.offline_turns system name."""


def run_engine_phase(
    lm, names: list[str], requests: list, plan, max_num_seqs: int, num_kv_blocks: int, problems: dict[str, str]
) -> dict[str, dict]:
    """Run `names` side by side on `plan`'s arrivals; -> {name: phase summary} of those that finished."""
    from ferry.bench.offline_turns import engine_config, engine_turns, side_by_side

    turns = {}
    for name in names:
        mode = ENGINE_SYSTEMS[name]
        config = engine_config(mode, max_num_seqs, num_kv_blocks)
        turns[name] = _guarded(
            engine_turns(lm, config, requests, plan.arrivals_s, mode), f"{name}, {plan.name}", problems
        )
    results = side_by_side(turns, len(requests) * len(turns), True)
    return {name: result.summary() for name, result in results.items() if result is not None}


def _guarded(turns, label: str, problems: dict[str, str]):
    """`turns`, but a ValueError/NotImplementedError (a mode offline_turns cannot run on this schedule)
    ends it with None and a problem entry instead of ending every system's run."""
    try:
        return (yield from turns)
    except (ValueError, NotImplementedError) as exc:
        problems[label] = f"not measured: ferry.bench.offline_turns says {type(exc).__name__}: {exc}"
        return None


def load(model_dir, threads: int, workload):
    """The checkpoint (loaded once, shared by every engine) and the workload as token ids."""
    import torch

    from ferry.bench.workload import make_workload
    from ferry.model import load_model

    torch.set_num_threads(threads)
    return load_model(str(model_dir)), make_workload(workload)
