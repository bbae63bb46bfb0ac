"""Would a decode worker computing a warm request's few new tokens beside its running batch (conditional
disaggregation) give a turn >= 2 request a shorter TTFT than the prefill worker's step does now?

In-process, 1 torch thread, nothing else running: `batch` sequences decode on contexts of ~`ctx` tokens; we time
the plain decode steps (median), then the step that also computes a warm request's `new` uncached tokens on a
cached `ctx`-token history (the conditional path's first-token step), and the same prefill step alone (what the
prefill worker runs today). A request that reaches the decode worker mid-step waits for that step first, so the
conditional path's TTFT floor is ~half a decode step + the mixed step; today's is the prefill step alone.

    /work/tools/cpu-bench python ops/bench/multiturn/mixed_step_cost.py /tmp/kv-bench/bench-model
"""

import os
import random
import statistics
import sys
import time

import torch

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.protocol.messages import SamplingParams

CTX = 512
NEW = [16, 34, 48]
BATCHES = [8, 16]
REPS = int(os.environ.get("REPS", "3"))


def main(model: str) -> None:
    torch.set_num_threads(1)
    engine = LLMEngine.from_model_path(model, EngineConfig(num_kv_blocks=2048, max_num_seqs=32))
    engine.warmup()
    rng = random.Random(0)
    n = 0

    def tokens(k: int) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(k)]

    def add(prompt: list[int], max_tokens: int) -> str:
        nonlocal n
        n += 1
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"r{n}", prompt, sp)
        return f"r{n}"

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return (time.perf_counter() - start) * 1000

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    for new in NEW:  # the prefill worker's step today: a warm history, `new` tokens, nothing else running
        alone = []
        for _ in range(REPS):
            history = tokens(CTX)
            add(history + [5], 1)
            drain()
            add(history + tokens(new), 1)
            alone.append(timed_step())
            drain()
        print(f"prefill alone  ctx {CTX} new {new:3d}: {statistics.median(alone):6.1f} ms")

    for batch in BATCHES:
        for new in NEW:
            decode, mixed = [], []
            for _ in range(REPS):
                for _ in range(batch):
                    add(tokens(CTX), 400)
                while any(s.seq.num_computed_tokens < CTX for s in engine._requests.values()):
                    engine.step()  # the batch's prompts: all decoding after this
                decode += [timed_step() for _ in range(5)]
                history = tokens(CTX)
                warm = add(history + [5], 1)
                while warm in engine._requests:
                    engine.step()  # its history computed beside the decodes, and cached
                add(history + tokens(new), 1)
                mixed.append(timed_step())
                for rid in list(engine._requests):
                    engine.abort_request(rid)
            d, m = statistics.median(decode), statistics.median(mixed)
            print(
                f"batch {batch:2d} ctx {CTX} new {new:3d}: decode step {d:6.1f} ms, decode + new tokens {m:6.1f} ms,"
                f" conditional TTFT floor ~{d / 2 + m:6.1f} ms"
            )


if __name__ == "__main__":
    main(sys.argv[1])
