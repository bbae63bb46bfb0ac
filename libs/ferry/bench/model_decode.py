"""Decode-step benchmark: ferry's paged-cache forward (fused CPU decode kernel, and the plain-torch
reference path) vs transformers' forward with its own KV cache.

Same checkpoint (a `ferry make-model --size bench` Llama unless --model is given), same batch of
sequences with the same context, same fed tokens; the four sides' decode steps are interleaved
step by step so machine noise hits all alike (the ferry sides share the weights and differ only
in the backend ('cpu': the C++ kernels, 'torch': the reference, as FERRY_CPU_KERNELS=1/0 resolve),
or in the KV cache's dtype: fp32 like the model, or bf16 as
EngineConfig.kv_cache_dtype='bfloat16' gives; the math stays fp32 on every side). Also measures this
machine's dense fp32 matmul rate in the same run and reports model FLOP/s as a fraction of it (of
the run's best rate, and of one-matmul probes timed between the steps, which see the same load as the
steps). --contexts adds a sweep of ferry fused vs reference over context lengths (cache filled with
random K/V instead of a prefill, so it stays cheap).
Writes <out>/model_decode.json and .png.

    python ops/bench/model_decode.py --out ops/bench/reports/model_decode
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ferry.bench.offline_report import dense_matmuls


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint folder (default: a fresh bench-size llama)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="tokens already cached per sequence")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per system")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument(
        "--contexts",
        default="",
        help="comma-separated context lengths for the fused-vs-reference sweep, e.g. 64,256,1024 (default: none)",
    )
    p.add_argument("--sweep-steps", type=int, default=6, help="decode steps timed per side and context in the sweep")
    p.add_argument("--out", type=Path, default=Path("ops/bench/reports/model_decode"))
    return p.parse_args()


def matmul_rate(n: int = 1024, repeats: int = 8) -> float:
    """Best observed dense fp32 matmul FLOP/s on this machine (n x n x n), over every way torch has
    to do it (MKL, oneDNN with a packed operand: ferry.bench.offline_report.dense_matmuls)."""
    best = float("inf")
    for op in dense_matmuls(n).values():
        op()
        for _ in range(repeats):
            t0 = time.perf_counter()
            op()
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def matmul_probe(n: int = 1024) -> tuple[float, float]:
    """One n x n x n fp32 matmul between decode steps, the fastest way this torch has -> (FLOP/s by wall
    time, FLOP/s by this thread's CPU time). With 1 torch thread the CPU-time rate ignores time the box's
    other processes took from us."""
    ops = dense_matmuls(n)
    op = ops.get("onednn_packed", ops["mkl"])
    op()
    _, wall_s, cpu_s = timed(op)
    return 2 * n**3 / wall_s, 2 * n**3 / cpu_s


def decode_flops(cfg, batch: int, context: int) -> float:
    """Model FLOPs of one decode step: 2 per weight per token for every matmul (embedding lookup
    excluded, lm_head included) plus QK^T and PV over the context."""
    d, kv = cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (cfg.num_heads * d + 2 * kv) + cfg.num_heads * d * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    weights = cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size
    attention = cfg.num_layers * 4 * cfg.num_heads * d * (context + 1)
    return batch * (2 * weights + attention)


class FerrySide:
    """One ferry decode batch with its own KV cache; fused picks the CPU decode kernel or the torch reference,
    kv_dtype the cache's dtype (None: the model's)."""

    def __init__(
        self,
        lm,
        batch: int,
        context: int,
        block_size: int,
        steps: int,
        fused: bool = True,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        from ferry.model import AttentionMetadata

        self.meta_cls, self.lm, self.fused = AttentionMetadata, lm, fused
        self.batch, self.block_size, self.context = batch, block_size, context
        blocks = -(-(context + steps + 1) // block_size)
        self.kv = self.lm.model.make_kv_cache(batch * blocks, block_size, dtype=kv_dtype)
        self.tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]

    def _use_backend(self) -> None:
        """Lanes may share the model with another backend: switch it when it differs, as the engine sets it
        once (set_attention_backend walks every module: ~1.5 ms a step on SmolLM2, which a per-step call
        added to every side's step and so shrank every ratio of a fast side to a slow one)."""
        backend = "cpu" if self.fused else "torch"
        if self.lm.model.attention_backend != backend:
            self.lm.model.set_attention_backend(backend)

    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:  # [B, C] -> [B, vocab]
        batch, length = prompts.shape
        self._use_backend()
        meta = self.meta_cls.build([length] * batch, [0] * batch, self.tables, self.block_size)
        return self.lm.model(prompts.flatten(), torch.arange(length).repeat(batch), meta, self.kv)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:  # [B] -> [B, vocab]
        self._use_backend()
        meta = self.meta_cls.build([1] * self.batch, [self.context] * self.batch, self.tables, self.block_size)
        logits = self.lm.model(tokens, torch.full((self.batch,), self.context), meta, self.kv)
        self.context += 1
        return logits


class TransformersSide:
    def __init__(self, path: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.cache = transformers.DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        return self.model(prompts, cache=self.cache, use_cache=True).logits[:, -1]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens[:, None], cache=self.cache, use_cache=True).logits[:, -1]


def timed(fn, *args):
    """-> (fn's result, wall seconds, seconds of this thread's CPU time)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    out = fn(*args)
    return out, time.perf_counter() - t0, time.thread_time() - c0


def summarize(
    times: list[float],
    batch: int,
    flops: float,
    rate: float,
    probes: dict | None = None,
    cpu_times: list[float] | None = None,
) -> dict:
    """rate: the best matmul rate of the run (wall time). probes: medians of one-matmul probes timed
    between the steps, by wall time and by CPU time; on a shared, busy box the CPU-time fraction (step
    CPU time vs matmul CPU time, 1 thread) is the one the other processes disturb least."""
    med = statistics.median(times)
    out = {
        "step_s_median": med,
        "step_s_min": min(times),
        "step_s_all": times,
        "tokens_per_s": batch / med,
        "model_flops_per_s": flops / med,
        "fraction_of_matmul_rate": flops / med / rate,
    }
    if probes:
        out["fraction_of_interleaved_matmul_rate"] = flops / med / probes["wall"]
    if probes and cpu_times:
        cpu_med = statistics.median(cpu_times)
        out |= {
            "step_cpu_s_median": cpu_med,
            "tokens_per_cpu_s": batch / cpu_med,
            "fraction_of_matmul_rate_cpu_time": flops / cpu_med / probes["cpu"],
        }
    return out


def run(args: argparse.Namespace, path: Path) -> dict:
    from ferry.kernels import fused_decode_enabled
    from ferry.model import load_model

    assert fused_decode_enabled(), "the fused CPU decode kernel is unavailable (see the warning above)"
    prompts = torch.randint(0, 1024, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    rate_before = matmul_rate()
    lm = load_model(path)
    sides: dict[str, Any] = {
        "ferry": FerrySide(lm, args.batch, args.context, args.block_size, args.steps, fused=True),
        "ferry_bf16_kv": FerrySide(
            lm, args.batch, args.context, args.block_size, args.steps, fused=True, kv_dtype=torch.bfloat16
        ),
        "ferry_reference": FerrySide(lm, args.batch, args.context, args.block_size, args.steps, fused=False),
        "transformers": TransformersSide(path),
    }
    prefill_s, logits = {}, {}
    for name, side in sides.items():
        logits[name], prefill_s[name], _ = timed(side.prefill, prompts)
    max_diff = float((logits["ferry"] - logits["transformers"]).abs().max())
    tokens = logits["ferry"].argmax(-1)
    times: dict[str, list[float]] = {name: [] for name in sides}
    cpu_times: dict[str, list[float]] = {name: [] for name in sides}
    agree, probes = 0, []
    same_as_fp32_kv = 0  # tokens where the bf16-cache side's greedy choice equals the fp32-cache side's
    for _ in range(args.steps + 2):  # all fed the same tokens; the first two steps are warm-up
        for name, side in sides.items():
            logits[name], dt, cpu = timed(side.step, tokens)
            times[name].append(dt)
            cpu_times[name].append(cpu)
        probes.append(matmul_probe())
        exact = [out for name, out in logits.items() if name != "ferry_bf16_kv"]
        agree += int(all(torch.equal(logits["ferry"].argmax(-1), out.argmax(-1)) for out in exact))
        same_as_fp32_kv += int((logits["ferry_bf16_kv"].argmax(-1) == logits["ferry"].argmax(-1)).sum())
        tokens = logits["ferry"].argmax(-1)
    sweep = [sweep_point(lm, args, c) for c in parse_contexts(args.contexts)]
    rate = max(rate_before, matmul_rate(), *(wall for wall, _ in probes))
    probe_rates = {
        "wall": statistics.median(w for w, _ in probes[2:]),
        "cpu": statistics.median(c for _, c in probes[2:]),
    }
    times = {name: t[2:] for name, t in times.items()}
    cpu_times = {name: t[2:] for name, t in cpu_times.items()}
    flops = decode_flops(lm.config, args.batch, args.context + args.steps // 2)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "workload": {
            "batch": args.batch,
            "context_tokens": args.context,
            "timed_steps": args.steps,
            "block_size": args.block_size,
            "dtype": "float32",
            "kv_cache_dtype": "float32 (ferry_bf16_kv: bfloat16)",
            "model": str(path),
        },
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "load_avg_1m_end": os.getloadavg()[0],
            "matmul_flops_per_s": rate,
            "matmul_flops_per_s_interleaved_median": probe_rates["wall"],
            "matmul_flops_per_cpu_s_interleaved_median": probe_rates["cpu"],
        },
        "flops_per_step": flops,
        **{
            name: summarize(t, args.batch, flops, rate, probe_rates, cpu_times[name]) | {"prefill_s": prefill_s[name]}
            for name, t in times.items()
        },
        "speedup_median_step": med["transformers"] / med["ferry"],
        "speedup_per_step_pair_median": statistics.median(h / f for h, f in zip(times["transformers"], times["ferry"])),
        "fused_vs_reference_speedup_median_step": med["ferry_reference"] / med["ferry"],
        "fused_vs_reference_per_step_pair_median": statistics.median(
            r / f for r, f in zip(times["ferry_reference"], times["ferry"])
        ),
        "prefill_logits_max_abs_diff": max_diff,
        "steps_with_identical_greedy_tokens": f"{agree}/{args.steps + 2} (ferry, ferry_reference, transformers)",
        "bf16_kv_greedy_tokens_equal_to_fp32_kv": f"{same_as_fp32_kv}/{(args.steps + 2) * args.batch}",
        "context_sweep": [
            {
                "context_tokens": p["context_tokens"],
                "flops_per_step": p["flops_per_step"],
                "fused_vs_reference_per_step_pair_median": statistics.median(
                    r / f for r, f in zip(p["reference"], p["fused"])
                ),
                "times_are": "thread CPU seconds; rate basis: the CPU-time matmul probes",
                **{
                    side: summarize(p[side], args.batch, p["flops_per_step"], probe_rates["cpu"])
                    for side in ("fused", "reference")
                },
            }
            for p in sweep
        ],
    }


def parse_contexts(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def sweep_point(lm, args: argparse.Namespace, context: int) -> dict:
    """ferry fused vs reference at one context length, steps interleaved; the caches hold random K/V
    (speed does not depend on the values) so no prefill is needed."""
    sides = [FerrySide(lm, args.batch, context, args.block_size, args.sweep_steps, fused=f) for f in (True, False)]
    for side in sides:
        side.kv.data.normal_()
    tokens = torch.randint(0, 1024, (args.batch,), generator=torch.Generator().manual_seed(1))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(args.sweep_steps + 1):  # the first step is warm-up
        for side, t in zip(sides, times):
            t.append(timed(side.step, tokens)[2])  # CPU time: the sweep compares kernels, not the box's load
    flops = decode_flops(lm.config, args.batch, context + args.sweep_steps // 2)
    print(
        f"context {context}: fused {statistics.median(times[0][1:]) * 1e3:.1f} CPU-ms/step, "
        f"reference {statistics.median(times[1][1:]) * 1e3:.1f} CPU-ms/step"
    )
    return {"context_tokens": context, "fused": times[0][1:], "reference": times[1][1:], "flops_per_step": flops}


NAMES = {
    "ferry": "ferry (fused CPU kernel)",
    "ferry_bf16_kv": "ferry (fused, bf16 KV cache)",
    "ferry_reference": "ferry (torch reference)",
    "transformers": "transformers (DynamicCache)",
}
COLORS = {
    "ferry": "tab:blue",
    "ferry_bf16_kv": "tab:purple",
    "ferry_reference": "tab:cyan",
    "transformers": "tab:orange",
}


def plot(result: dict, file: Path) -> None:
    from ferry.bench.plots import pyplot, save_figure

    plt = pyplot()

    sweep = result["context_sweep"]
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(16 if sweep else 11, 4))
    left, right = axes[0], axes[1]
    left.bar(
        [NAMES[n].replace(" (", "\n").replace(", ", "\n").rstrip(")") for n in NAMES],
        [result[n]["tokens_per_s"] for n in NAMES],
        color=list(COLORS.values()),
    )
    left.tick_params(axis="x", labelsize=8)
    left.set_ylabel("decode tokens/s (median step)")
    w = result["workload"]
    left.set_title(
        f"batch {w['batch']}, context ~{w['context_tokens']}, fp32 math; of the matmul rate: ferry "
        f"{result['ferry']['fraction_of_matmul_rate']:.0%}, with a bf16 KV cache "
        f"{result['ferry_bf16_kv']['fraction_of_matmul_rate']:.0%}",
        fontsize=9,
    )
    for name in NAMES:
        right.plot([t * 1e3 for t in result[name]["step_s_all"]], marker="o", label=NAMES[name], color=COLORS[name])
    right.set_xlabel("decode step (interleaved)")
    right.set_ylabel("step time (ms)")
    right.legend(fontsize=8)
    if sweep:
        ctx = [p["context_tokens"] for p in sweep]
        for key, name in (("fused", "ferry"), ("reference", "ferry_reference")):
            axes[2].plot(
                ctx, [p[key]["tokens_per_s"] for p in sweep], marker="o", label=NAMES[name], color=COLORS[name]
            )
        axes[2].set_xscale("log", base=2)
        axes[2].set_xlabel("cached tokens per sequence")
        axes[2].set_ylabel("decode tokens per CPU second")
        axes[2].legend(fontsize=8)
    save_figure(fig, file)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from ferry.model.make_model import make_model

            path = make_model(Path(tmp) / "bench-llama", "llama", "bench", seed=0)
        result = run(args, path)
    (args.out / "model_decode.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "model_decode.png")
    f, b, r, h = result["ferry"], result["ferry_bf16_kv"], result["ferry_reference"], result["transformers"]
    print(
        f"ferry fused {f['tokens_per_s']:.0f} tok/s ({f['fraction_of_matmul_rate']:.1%} of matmul rate), "
        f"with a bf16 KV cache {b['tokens_per_s']:.0f} tok/s ({b['fraction_of_matmul_rate']:.1%}, greedy tokens "
        f"equal to fp32 KV's: {result['bf16_kv_greedy_tokens_equal_to_fp32_kv']}), "
        f"[by CPU time {f['fraction_of_matmul_rate_cpu_time']:.1%} vs reference "
        f"{r['fraction_of_matmul_rate_cpu_time']:.1%}], "
        f"ferry reference {r['tokens_per_s']:.0f} tok/s ({r['fraction_of_matmul_rate']:.1%}), "
        f"transformers {h['tokens_per_s']:.0f} tok/s; fused vs transformers {result['speedup_median_step']:.2f}x, "
        f"fused vs reference {result['fused_vs_reference_speedup_median_step']:.2f}x -> {args.out}"
    )


if __name__ == "__main__":
    main()
