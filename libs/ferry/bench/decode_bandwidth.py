"""Decode-step memory bandwidth: how close one decode step of the model comes to the device's peak.

A decode step reads every weight once plus each sequence's cached K/V; at small batch that traffic is
the whole cost, so bytes moved / step time, as a fraction of the device's bandwidth, says how much
of the card a step uses. The step is the model's forward on a batch of B sequences with C cached
tokens each (metadata built outside the timed region, as the engine overlaps it), timed over many
steps. The peak is measured in the same run (a large device-to-device copy: read + write bytes) and,
for known cards, also given as the datasheet figure. On CUDA the timed steps run under
torch.cuda.set_sync_debug_mode('error'): a forward that waits for the device fails the check.
Eager steps pay one host launch per kernel; on CUDA the same step is also captured as one CUDA graph
and replayed (as the engine's DecodeGraphs does), so the report separates launch overhead
(`step_ms` vs `graph_step_ms`) from what the kernels themselves achieve (`graph_achieved_gb_s`).

`python -m ferry.bench.decode_bandwidth --model DIR [--device cuda] [--batch 1,8,32] --out FILE.json`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from ferry.model import AttentionMetadata, load_model

DATASHEET_GB_S = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0}
"""HBM bandwidth by card name fragment (first match wins), GB/s."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_peak_gb_s(device: torch.device, size_mb: int) -> float:
    """Best of a few large copies on the device: (read + write) bytes / time."""
    src = torch.empty(size_mb * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def datasheet_gb_s(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gb for key, gb in DATASHEET_GB_S.items() if key in name), None)


def step_bytes(lm, kv, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight (a tied embedding once) and every cached token's K/V."""
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    per_token = kv.data[:, :, :, 0, 0].numel() * kv.data.element_size()  # all layers, planes, heads, dims
    return weights + batch * (context + 1) * per_token


def time_decode(lm, device: torch.device, batch: int, context: int, steps: int, block_size: int) -> dict:
    blocks = -(-(context + 1) // block_size)
    kv = lm.model.make_kv_cache(batch * blocks, block_size, device)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    (ids, pos), meta = AttentionMetadata.build_with_inputs(
        [1] * batch, [context] * batch, tables, block_size, [7] * batch, device
    )
    for _ in range(3):  # compile the kernels, warm the allocator
        lm.model(ids, pos, meta, kv)
    _sync(device)
    guard = torch.cuda.set_sync_debug_mode if device.type == "cuda" else None
    sync_error = None
    start = time.perf_counter()
    try:
        with _sync_debug(guard):
            for _ in range(steps):
                lm.model(ids, pos, meta, kv)
    except RuntimeError as exc:  # the forward synchronised with the host
        sync_error = str(exc).splitlines()[0]
    _sync(device)
    step_s = (time.perf_counter() - start) / steps
    moved = step_bytes(lm, kv, batch, context)
    graph_s = time_graph(lm, ids, pos, meta, kv, steps) if device.type == "cuda" and not sync_error else None
    return {
        "batch": batch,
        "context": context,
        "step_ms": step_s * 1e3,
        "bytes_per_step": moved,
        "achieved_gb_s": moved / step_s / 1e9,
        "graph_step_ms": graph_s and graph_s * 1e3,
        "graph_achieved_gb_s": graph_s and moved / graph_s / 1e9,
        "host_sync_in_forward": sync_error,
    }


def time_graph(lm, ids, pos, meta, kv, steps: int) -> float:
    """Seconds per replay of the step captured as one CUDA graph (inputs are the same kept tensors)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture needs the lazily made state (workspaces, autotuning) made
        for _ in range(2):
            lm.model(ids, pos, meta, kv)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lm.model(ids, pos, meta, kv)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


@contextlib.contextmanager
def _sync_debug(set_mode):
    if set_mode is None:
        yield
        return
    set_mode("error")
    try:
        yield
    finally:
        set_mode("default")


def run(model: Path, device: str, batches: list[int], context: int, steps: int, block_size: int, copy_mb: int) -> dict:
    dev = torch.device(device)
    lm = load_model(model, device=device)
    from ferry.kernels import resolve_attention

    lm.model.set_attention_backend(resolve_attention(dev))
    peak = measured_peak_gb_s(dev, copy_mb)
    sheet = datasheet_gb_s(dev)
    runs = [time_decode(lm, dev, b, context, steps, block_size) for b in batches]
    for r in runs:
        r["fraction_of_measured_peak"] = r["achieved_gb_s"] / peak
        r["fraction_of_datasheet_peak"] = r["achieved_gb_s"] / sheet if sheet else None
        graphed = r["graph_achieved_gb_s"]
        r["graph_fraction_of_datasheet_peak"] = graphed / sheet if graphed and sheet else None
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "model": str(model),
        "dtype": str(lm.model.lm_head.weight.dtype).removeprefix("torch."),
        "attention": lm.model.attention_backend,
        "measured_peak_gb_s": peak,
        "datasheet_peak_gb_s": sheet,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", default="1,8,32", help="batch sizes (default %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--copy-mb", type=int, default=1024, help="size of the peak-bandwidth copy")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    report = run(args.model, args.device, batches, args.context, args.steps, args.block_size, args.copy_mb)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 1 if any(r["host_sync_in_forward"] for r in report["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
