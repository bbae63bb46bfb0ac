"""A decode step of the in-process engine at several batch sizes: p50 wall time of 40 steps per batch, and with
--profile torch.profiler's op table over 20 more at the batches named. N sequences of 300-token prompts
(--prompt-tokens) decode greedily (ignore_eos), the served default (SmolLM2 Q4_1) unless --model says otherwise.
--kv-dtypes A,B: one engine per KV cache dtype at each batch, their steps interleaved (A, B, A, B, ...) so machine
noise hits them alike; --bf16-dot 0,1 likewise one engine per decode attention path for a bf16 cache
(cpu_decode.BF16_DOT set before each engine's step: widening to fp32, VDPBF16PS).

    /work/tools/cpu-bench python ops/bench/throughput/decode_step_profile.py [--model smollm2] [--profile 1,32]
        [--kv-dtypes bfloat16,float8_e4m3fn] [--bf16-dot 0,1] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ferry.engine import EngineConfig, LLMEngine
from ferry.kernels import cpu_decode
from ferry.model.loader import load_model
from ferry.model.source import resolve_model
from ferry.protocol import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a checkpoint folder, a .gguf file or smollm2 (default)")
    parser.add_argument("--batches", default="1,4,8,16,32,48", help="comma-separated batch sizes")
    parser.add_argument("--profile", default="", help="batch sizes to profile (comma-separated; none by default)")
    parser.add_argument("--kv-dtypes", default="", help="KV cache dtypes, comma-separated ('': the engine's default)")
    parser.add_argument("--bf16-dot", default="", help="decode attention paths to interleave, e.g. 0,1 ('': default)")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="each sequence's prompt length (default 300)")
    parser.add_argument("--json", type=Path, help="write the p50s here")
    args = parser.parse_args()
    lm = load_model(resolve_model(args.model))
    vocab = lm.config.vocab_size
    greedy = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    profiled = {int(b) for b in args.profile.split(",") if b}
    kv_dtypes = [name or None for name in args.kv_dtypes.split(",")]
    dots = [bool(int(x)) for x in args.bf16_dot.split(",")] if args.bf16_dot else [cpu_decode.BF16_DOT]
    variants = [(name, dot) for name in kv_dtypes for dot in dots]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        engines = {}
        for name, dot in variants:
            cpu_decode.BF16_DOT = dot
            blocks = max(1024, batch * ((args.prompt_tokens + 64) // 16 + 2))  # prompt + the steps run here
            engine = engines[name, dot] = LLMEngine(lm, EngineConfig(num_kv_blocks=blocks, kv_cache_dtype=name))
            for i in range(batch):
                prompt = [(7 * i + j) % (vocab - 10) + 10 for j in range(args.prompt_tokens)]
                engine.add_request(f"r{i}", prompt, greedy)
            for _ in range(12):  # the prompts' prefill and a few decode steps
                engine.step()
        times: dict[tuple[str | None, bool], list[float]] = {variant: [] for variant in engines}
        for _ in range(40):
            for (name, dot), engine in engines.items():
                cpu_decode.BF16_DOT = dot
                start = time.perf_counter()
                engine.step()
                times[name, dot].append(time.perf_counter() - start)
        for (name, dot), engine in engines.items():
            cpu_decode.BF16_DOT = dot
            p50_ms = statistics.median(times[name, dot]) * 1e3
            kv = engine.kv_cache_dtype
            rows.append(
                {
                    "batch": batch,
                    "context": args.prompt_tokens,
                    "kv_cache_dtype": kv,
                    "bf16_dot": dot,
                    "step_p50_ms": p50_ms,
                }
            )
            print(f"batch {batch}: kv {kv} bf16_dot {int(dot)}: decode step p50 {p50_ms:.2f} ms", flush=True)
            if batch in profiled:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(20):
                        engine.step()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
