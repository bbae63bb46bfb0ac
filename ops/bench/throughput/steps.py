"""Where the in-process engine's burst time goes: wall time per step class (steps with prefill tokens,
decode steps of > 8 sequences, the tail of <= 8), and with `ops` torch.profiler's per-op shares (of the
whole burst), `decode-ops` (of the decode steps of > 8 sequences only), `tail-ops` (from the first step of
<= 8 sequences after those to the end: the burst's tail) or `prefill-ops` (of the burst's first steps, up to and
including the first step without prompt tokens: its prefill steps).

    /work/tools/cpu-bench python ops/bench/throughput/steps.py smollm2 [steps|ops|decode-ops|tail-ops|prefill-ops]
    FERRY_QUANT_TILED_FROM_ROWS=1000000000 ...   # the quant kernel's register passes only (A/B)
    STEPS_KV_CACHE_DTYPE=bfloat16 ...             # the engine's kv_cache_dtype (A/B)
    STEPS_ORDER=shortest ...                      # the burst's waiting queue shortest prompt first (TTFT A/B)

It also prints the burst's TTFT p50 in the engine (from adding the requests to each one's first token).

The engine gets `ferry up`'s worker KV pool (1024 blocks), the burst is run.py's (seed 0).
"""

import collections
import os
import statistics
import sys
import time

import torch

from ferry.bench.throughput import burst
from ferry.engine import EngineConfig, LLMEngine
from ferry.model.config import read_config
from ferry.model.source import resolve_model
from ferry.protocol import SamplingParams

TAIL_SEQS = 8


def step_class(num_seqs: int, num_prefill_tokens: int) -> str:
    if num_prefill_tokens:
        return "prefill"
    return f"decode>{TAIL_SEQS}" if num_seqs > TAIL_SEQS else f"decode<={TAIL_SEQS}"


def main() -> None:
    model = str(resolve_model(sys.argv[1]))
    mode = sys.argv[2] if len(sys.argv) > 2 else "steps"
    engine = LLMEngine.from_model_path(
        model,
        EngineConfig(
            max_num_seqs=64, num_kv_blocks=1024, kv_cache_dtype=os.environ.get("STEPS_KV_CACHE_DTYPE") or None
        ),
    )
    requests = burst.burst_requests(read_config(model).vocab_size)
    engine.add_request("warm", requests[0].prompt_token_ids[:16], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    for r in requests:
        engine.add_request(str(r.index), r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0))
    if os.environ.get("STEPS_ORDER") == "shortest":  # what ordering a burst's prompts could buy TTFT, unbounded
        by_length = sorted(requests, key=lambda r: len(r.prompt_token_ids))
        engine.scheduler.reorder_waiting([str(r.index) for r in by_length])
    first_token_s: dict[str, float] = {}
    classes: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])  # steps, ms, tokens
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if mode != "steps" else None
    if profiler and mode in ("ops", "prefill-ops"):
        profiler.start()
    num_out, start, profiling, done = 0, time.perf_counter(), mode in ("ops", "prefill-ops"), False
    seen_large = False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_out += sum(len(o.new_token_ids) for o in outputs)
        for o in outputs:
            if o.new_token_ids:
                first_token_s.setdefault(o.request_id, time.perf_counter() - start)
        s = engine.last_step
        assert s is not None
        kind = step_class(s.num_seqs, s.num_prefill_tokens)
        if profiler and mode == "decode-ops" and kind == f"decode>{TAIL_SEQS}" and not profiling and not done:
            profiling = True  # after the prefills the batch only shrinks: the large decode steps run in one stretch
            profiler.start()
        elif profiler and mode == "tail-ops" and kind == f"decode<={TAIL_SEQS}" and seen_large and not profiling:
            profiling = True  # the tail: from here the batch only shrinks (this step itself is not profiled)
            profiler.start()
        elif profiler and profiling and mode == "prefill-ops" and kind != "prefill":
            profiling = False  # the burst's prompts are all admitted by now: its prefill steps are profiled
            profiler.stop()
        elif profiler and profiling and mode == "decode-ops" and kind != f"decode>{TAIL_SEQS}":
            profiling, done = False, True
            profiler.stop()
        seen_large = seen_large or kind == f"decode>{TAIL_SEQS}"
        c = classes[kind]
        c[0] += 1
        c[1] += s.duration_ms
        c[2] += s.num_prefill_tokens or s.num_seqs
    wall = time.perf_counter() - start
    if profiler and profiling:
        profiler.stop()
    ttft_p50 = statistics.median(first_token_s.values())
    print(f"wall {wall:.2f} s, {num_out} tokens, {num_out / wall:.1f} tok/s, TTFT p50 {ttft_p50:.2f} s")
    for name, (steps, ms, tokens) in classes.items():
        print(f"  {name:10s} steps {steps:4.0f} {ms / 1000:6.2f} s ({ms / 10 / wall:4.1f}%) tokens {tokens:.0f}")
    if profiler:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=24, max_name_column_width=40))


if __name__ == "__main__":
    main()
