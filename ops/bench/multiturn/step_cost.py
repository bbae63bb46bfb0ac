"""What one prefill step costs the engine in-process (1 torch thread, nothing else running): a prompt of
`new` tokens on a cached context of `ctx` tokens (the shape of a multi-turn request whose history is
local), median of 5. The floor under a turn >= 2 request's TTFT: the multi-turn README reads it.

    /work/tools/cpu-bench python ops/bench/multiturn/step_cost.py /tmp/kv-bench/bench-model
"""

import random
import statistics
import sys
import time

import torch

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.protocol.messages import SamplingParams

SHAPES = [(0, 16), (0, 48), (0, 96), (0, 288), (288, 16), (288, 48), (288, 96), (600, 48), (1200, 48)]


def main(model: str) -> None:
    torch.set_num_threads(1)
    engine = LLMEngine.from_model_path(model, EngineConfig(num_kv_blocks=1024, max_num_seqs=16))
    engine.warmup()
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    n = 0

    def run(tokens: list[int]) -> float:
        nonlocal n
        n += 1
        engine.add_request(f"r{n}", tokens, greedy)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return (time.perf_counter() - start) * 1000

    for ctx, new in SHAPES:
        times = []
        for _ in range(5):
            history = [rng.randrange(3, 2000) for _ in range(ctx)]
            if ctx:
                run(history + [5])  # its blocks stay cached in the pool
            times.append(run(history + [rng.randrange(3, 2000) for _ in range(new)]))
        print(f"context {ctx:5d} new {new:4d}: step {statistics.median(times):6.1f} ms (min {min(times):.1f})")


if __name__ == "__main__":
    main(sys.argv[1])
