"""Decode-step benchmark: ferry's paged-cache forward vs transformers' forward with its own KV cache.

Same checkpoint (a `ferry make-model --size bench` Llama unless --model is given), same batch of
sequences with the same context, same fed tokens; the two systems' decode steps are interleaved
step by step so machine noise hits both alike. Also measures this machine's dense fp32 matmul rate
in the same run and reports model FLOP/s as a fraction of it. Writes <out>/model_decode.json and .png.

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

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint folder (default: a fresh bench-size llama)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="tokens already cached per sequence")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per system")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=Path, default=Path("ops/bench/reports/model_decode"))
    return p.parse_args()


def matmul_rate(n: int = 1024, repeats: int = 8) -> float:
    """Best observed dense fp32 matmul FLOP/s on this machine (n x n x n)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


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
    def __init__(self, path: Path, batch: int, context: int, block_size: int, steps: int) -> None:
        from ferry.model import AttentionMetadata, load_model

        self.meta_cls, self.lm = AttentionMetadata, load_model(path)
        self.batch, self.block_size, self.context = batch, block_size, context
        blocks = -(-(context + steps + 1) // block_size)
        self.kv = self.lm.model.make_kv_cache(batch * blocks, block_size)
        self.tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]

    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:  # [B, C] -> [B, vocab]
        batch, length = prompts.shape
        meta = self.meta_cls.build([length] * batch, [0] * batch, self.tables, self.block_size)
        return self.lm.model(prompts.flatten(), torch.arange(length).repeat(batch), meta, self.kv)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:  # [B] -> [B, vocab]
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
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def run(args: argparse.Namespace, path: Path) -> dict:
    prompts = torch.randint(0, 1024, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    rate_before = matmul_rate()
    ferry, hf = FerrySide(path, args.batch, args.context, args.block_size, args.steps), TransformersSide(path)
    ferry_logits, ferry_prefill_s = timed(ferry.prefill, prompts)
    hf_logits, hf_prefill_s = timed(hf.prefill, prompts)
    max_diff = float((ferry_logits - hf_logits).abs().max())
    tokens = ferry_logits.argmax(-1)
    ferry_s, hf_s, agree = [], [], 0
    for _ in range(args.steps + 2):  # both fed the same tokens; the first two steps are warm-up
        ferry_logits, dt_ferry = timed(ferry.step, tokens)
        hf_logits, dt_hf = timed(hf.step, tokens)
        ferry_s.append(dt_ferry)
        hf_s.append(dt_hf)
        agree += int(torch.equal(ferry_logits.argmax(-1), hf_logits.argmax(-1)))
        tokens = ferry_logits.argmax(-1)
    rate = max(rate_before, matmul_rate())
    ferry_s, hf_s = ferry_s[2:], hf_s[2:]
    flops = decode_flops(ferry.lm.config, args.batch, args.context + args.steps // 2)

    def summary(times: list[float]) -> dict:
        med = statistics.median(times)
        return {"step_s_median": med, "step_s_min": min(times), "step_s_all": times,
                "tokens_per_s": args.batch / med, "model_flops_per_s": flops / med,
                "fraction_of_matmul_rate": flops / med / rate}

    return {
        "workload": {"batch": args.batch, "context_tokens": args.context, "timed_steps": args.steps,
                     "block_size": args.block_size, "dtype": "float32", "model": str(path)},
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                    "load_avg_1m_end": os.getloadavg()[0], "matmul_flops_per_s": rate},
        "flops_per_step": flops,
        "ferry": summary(ferry_s) | {"prefill_s": ferry_prefill_s},
        "transformers": summary(hf_s) | {"prefill_s": hf_prefill_s},
        "speedup_median_step": statistics.median(hf_s) / statistics.median(ferry_s),
        "speedup_per_step_pair_median": statistics.median(h / f for h, f in zip(hf_s, ferry_s)),
        "prefill_logits_max_abs_diff": max_diff,
        "steps_with_identical_greedy_tokens": f"{agree}/{args.steps + 2}",
    }


def plot(result: dict, file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["ferry (paged)", "transformers (DynamicCache)"]
    sides = [result["ferry"], result["transformers"]]
    left.bar(names, [s["tokens_per_s"] for s in sides], color=["tab:blue", "tab:orange"])
    left.set_ylabel("decode tokens/s (median step)")
    w = result["workload"]
    left.set_title(f"batch {w['batch']}, context ~{w['context_tokens']}, fp32; "
                   f"speedup {result['speedup_median_step']:.2f}x")
    for name, side in zip(names, sides):
        right.plot([t * 1e3 for t in side["step_s_all"]], marker="o", label=name)
    right.set_xlabel("decode step (interleaved)")
    right.set_ylabel("step time (ms)")
    right.legend()
    fig.tight_layout()
    fig.savefig(file, dpi=110)


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
    f, h = result["ferry"], result["transformers"]
    print(f"ferry {f['tokens_per_s']:.0f} tok/s ({f['fraction_of_matmul_rate']:.1%} of matmul rate), "
          f"transformers {h['tokens_per_s']:.0f} tok/s; speedup {result['speedup_median_step']:.2f}x "
          f"-> {args.out}")


if __name__ == "__main__":
    main()
