"""A decode step of the in-process engine at several batch sizes: p50 wall time of 40 steps per batch, and with
--profile torch.profiler's op table over 20 more at the batches named. N sequences of 300-token prompts decode
greedily (ignore_eos), the served default (SmolLM2 Q4_1) unless --model says otherwise.

    /work/tools/cpu-bench python ops/bench/throughput/decode_step_profile.py [--model smollm2] [--profile 1,32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ferry.engine import EngineConfig, LLMEngine
from ferry.model.loader import load_model
from ferry.model.source import resolve_model
from ferry.protocol import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a checkpoint folder, a .gguf file or smollm2 (default)")
    parser.add_argument("--batches", default="1,4,8,16,32,48", help="comma-separated batch sizes")
    parser.add_argument("--profile", default="", help="batch sizes to profile (comma-separated; none by default)")
    args = parser.parse_args()
    lm = load_model(resolve_model(args.model))
    vocab = lm.config.vocab_size
    greedy = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    profiled = {int(b) for b in args.profile.split(",") if b}
    for batch in (int(b) for b in args.batches.split(",")):
        engine = LLMEngine(lm, EngineConfig(num_kv_blocks=1024))
        for i in range(batch):
            engine.add_request(f"r{i}", [(7 * i + j) % (vocab - 10) + 10 for j in range(300)], greedy)
        for _ in range(12):  # the prompts' prefill and a few decode steps
            engine.step()
        times = []
        for _ in range(40):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        print(f"batch {batch}: decode step p50 {statistics.median(times) * 1e3:.2f} ms", flush=True)
        if batch in profiled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    engine.step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)


if __name__ == "__main__":
    main()
