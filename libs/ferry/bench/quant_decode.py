"""Decode step with weights kept int8 / int4 vs fp32: one run, the three sides interleaved step by step.

The same checkpoint loaded three times (load_model weights_dtype float32, int8, int4: activations and KV
cache fp32 on every side), each with its own paged cache holding the same prompts; every step feeds all
sides the same tokens (the fp32 side's greedy choice), so they do identical work, and machine noise hits
them alike. For each batch size: median step time per side, and ratios fp32 / quantized both of the
medians and as the median of per-step pairs. Also counts how often each quantized side's greedy token
equals fp32's on those steps. Writes <out>/decode_step.json, decode_step.png.

    python ops/bench/quant/decode_step.py --model PATH --out ops/bench/quant/<run>
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

from ferry.bench.model_decode import FerrySide, timed

SIDES = ("float32", "int8", "int4")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder or .gguf (default: a fresh `bench`-size llama)")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=128, help="prompt tokens cached per sequence")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per side and batch")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=Path, default=Path("ops/bench/quant/latest"))
    return p.parse_args()


def weight_bytes(lm) -> int:
    """Bytes of every matmul weight the decode step streams (quantized codes + scales, or fp32)."""
    from ferry.model.quant_linear import quantized_bytes

    dense = sum(
        m.weight.numel() * m.weight.element_size()
        for m in lm.model.modules()
        if isinstance(m, torch.nn.Linear) and not getattr(m, "is_fused", False)
    )
    fused = sum(
        v.weight.numel() * v.weight.element_size()
        for m in lm.model.modules()
        for v in vars(m).values()
        if type(v).__name__ == "FusedProjection"
    )
    return dense + fused + quantized_bytes(lm.model)


QUALITY_TEXT = (
    "The river town woke slowly. Fishermen pulled their boats onto the gravel while the baker opened "
    "the shutters and set out the first loaves of the day. Children ran past the church towards the "
    "school, where the teacher was writing the date on the blackboard and a short list of words to "
    "learn: harbour, lantern, weather, patience. In the afternoon a storm came in from the sea. The "
    "wind bent the poplars along the road, rain drummed on the roofs, and the ferry that crossed the "
    "estuary twice an hour stayed tied to its pier. Nobody minded much; the market would open again "
    "tomorrow, the nets could be mended indoors, and the old men in the cafe had a new subject for "
    "their endless arguments. By evening the clouds broke apart, the light turned gold over the "
    "water, and the first lamps were lit in the windows of the houses on the hill. A cat watched the "
    "gulls from a wall, the baker counted the coins in his drawer, and the ferryman, finally free to "
    "work, carried a doctor, two students and a crate of oranges to the other side. Later, when the "
    "stars were out, the teacher sat at her kitchen table marking notebooks, smiling at a drawing of "
    "a lighthouse that one of the children had made in the margin of a page of sums."
)
"""A fixed English text (ours) for the teacher-forced quality check: its first 256 tokens are fed."""


def all_position_logits(lm, ids: list[int]) -> torch.Tensor:
    """Teacher forcing: one prefill of ids -> float32 logits [T, vocab] of the next token at every position."""
    import dataclasses

    from ferry.model import AttentionMetadata

    num_blocks = -(-len(ids) // 16)
    kv = lm.model.make_kv_cache(num_blocks=num_blocks, block_size=16)
    meta = AttentionMetadata.build([len(ids)], [0], [list(range(num_blocks))], 16)
    meta = dataclasses.replace(meta, logits_indices=torch.arange(len(ids)))
    return lm.model(torch.tensor(ids), torch.arange(len(ids)), meta, kv)


def cached_decode_logits(lm, ids: list[int], kv_dtype: torch.dtype | None = None, prompt: int = 16) -> torch.Tensor:
    """Teacher forcing through the KV cache, as serving reads it: a prefill of ids[:prompt], then one decode
    step per following token of ids, each attending to the cache (of kv_dtype; None: the model's) ->
    float32 logits [T - prompt, vocab] of the next token after positions prompt-1 .. T-2."""
    from ferry.model import AttentionMetadata

    num_blocks = -(-len(ids) // 16)
    kv = lm.model.make_kv_cache(num_blocks=num_blocks, block_size=16, dtype=kv_dtype)
    table = [list(range(num_blocks))]
    meta = AttentionMetadata.build([prompt], [0], table, 16)
    out = [lm.model(torch.tensor(ids[:prompt]), torch.arange(prompt), meta, kv)]
    for pos in range(prompt, len(ids) - 1):
        meta = AttentionMetadata.build([1], [pos], table, 16)
        out.append(lm.model(torch.tensor(ids[pos : pos + 1]), torch.tensor([pos]), meta, kv))
    return torch.cat(out)


def agreement(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Next-token agreement of two [T, vocab] logits: argmax equal rate and mean KL(ref || got) in nats."""
    log_ref, log_got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (log_ref.exp() * (log_ref - log_got)).sum(-1)
    return {"argmax_equal_rate": float((ref.argmax(-1) == got.argmax(-1)).float().mean()), "mean_kl": float(kl.mean())}


def quality(models: dict, num_tokens: int = 256) -> dict:
    """Teacher-forced on QUALITY_TEXT's first num_tokens tokens: each quantized side against float32."""
    ids = models["float32"].tokenizer.encode(QUALITY_TEXT)[:num_tokens]
    assert len(ids) == num_tokens, f"QUALITY_TEXT has only {len(ids)} tokens"
    ref = all_position_logits(models["float32"], ids)
    return {name: agreement(ref, all_position_logits(lm, ids)) for name, lm in models.items() if name != "float32"}


def run_batch(models: dict, batch: int, args: argparse.Namespace, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, args.context), generator=gen)
    sides = {name: FerrySide(lm, batch, args.context, 16, args.steps + 2) for name, lm in models.items()}
    logits = {name: side.prefill(prompts) for name, side in sides.items()}
    tokens = logits["float32"].argmax(-1)
    times: dict[str, list[float]] = {name: [] for name in sides}
    same = {name: 0 for name in sides}
    for step in range(args.steps + 2):  # the first two steps are warm-up
        for name, side in sides.items():
            logits[name], wall_s, _ = timed(side.step, tokens)
            if step >= 2:
                times[name].append(wall_s)
        tokens = logits["float32"].argmax(-1)
        for name in sides:
            same[name] += int((logits[name].argmax(-1) == tokens).sum())
    os.environ.pop("FERRY_CPU_KERNELS", None)
    med = {name: statistics.median(t) for name, t in times.items()}
    row: dict[str, object] = {"batch": batch, **{f"{name}_step_ms_median": med[name] * 1e3 for name in sides}}
    for name in ("int8", "int4"):
        row[f"{name}_speedup_median_step"] = med["float32"] / med[name]
        row[f"{name}_speedup_per_step_pair_median"] = statistics.median(
            f / q for f, q in zip(times["float32"], times[name])
        )
        row[f"{name}_greedy_equal_to_fp32"] = f"{same[name]}/{(args.steps + 2) * batch}"
    row["step_s_all"] = times
    print(
        f"batch {batch}: fp32 {med['float32'] * 1e3:.1f} ms, int8 {med['int8'] * 1e3:.1f} ms "
        f"({row['int8_speedup_median_step']:.2f}x), int4 {med['int4'] * 1e3:.1f} ms "
        f"({row['int4_speedup_median_step']:.2f}x)",
        flush=True,
    )
    return row


def plot(report: dict, path: Path) -> None:
    from ferry.bench.plots import pyplot, save_figure

    plt = pyplot()

    rows = report["batches"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, name in enumerate(SIDES):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [r[f"{name}_step_ms_median"] for r in rows], width, label=f"weights {name}")
    ax.set_xticks(range(len(rows)), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("decode step, ms (median)")
    ax.set_yscale("log")
    ax.set_title(f"decode step by weights dtype: {report['workload']['model_name']}")
    ax.legend()
    save_figure(fig, path)


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from ferry.kernels import fused_decode_enabled
    from ferry.model import load_model
    from ferry.model.make_model import make_model

    assert fused_decode_enabled(), "the C++ CPU kernels are unavailable (see the warning above)"
    path = args.model or make_model(Path(tempfile.mkdtemp()) / "bench", "llama", "bench", seed=0)
    models = {name: load_model(path, weights_dtype=name) for name in SIDES}
    vocab = models["float32"].config.vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    started = time.time()
    rows = [run_batch(models, b, args, vocab) for b in batches]
    report = {
        "workload": {
            "model": str(path),
            "model_name": Path(str(path)).name,
            "is_random": models["float32"].is_random,
            "context_tokens": args.context,
            "timed_steps": args.steps,
            "activations": "float32",
            "kv_cache_dtype": "float32",
            "fed_tokens": "fp32 side's greedy tokens, the same for every side",
        },
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "load_avg_1m_end": os.getloadavg()[0],
            "run_s": time.time() - started,
        },
        "weight_bytes_streamed_per_step": {name: weight_bytes(lm) for name, lm in models.items()},
        "teacher_forced_vs_float32_256_tokens": quality(models),
        "fingerprints": {name: lm.fingerprint for name, lm in models.items()},
        "batches": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_step.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "decode_step.png")
    print(json.dumps({k: v for k, v in report.items() if k != "batches"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
