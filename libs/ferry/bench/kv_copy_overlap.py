"""KV copies beside decode steps: do the KvCopier's copies overlap the engine's steps (CUDA)?

An engine decodes a batch; the same steps are timed three ways, side by side in one run:
  steps      K engine steps alone;
  copies     K rounds of copying M blocks out (KvCopier.copy_out, waited for) and M blocks in
             (stage + write), alone;
  both       K steps, each with a copy out started just before it and the blocks staged for the next
             step's write: what a worker does while hand-offs come and go.
overlap = (steps + copies - both) / min(steps, copies): 1 when the copies hide entirely behind the
steps, 0 when they add up. Also reported: the engine thread's time inside copy_out / write per call
(it must not wait for the copy), and whether every block copied out equals the pool's
(PagedKVCache.read_blocks) byte for byte. On the CPU the copies are synchronous by design: overlap is
not computed (null).

`python -m ferry.bench.kv_copy_overlap --model DIR [--device cuda] [--blocks 256] --out FILE.json`
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ferry.engine import EngineConfig, LLMEngine
from ferry.engine.kv_copy import KvCopier, OutCopy
from ferry.protocol import SamplingParams


def _sync(engine: LLMEngine) -> None:
    if engine.copier.is_cuda:
        torch.cuda.synchronize(engine.copier.device)


def decoding_engine(
    model: Path, device: str, dtype: str | None, batch: int, context: int, max_tokens: int
) -> LLMEngine:
    """An engine (warmed up) whose `batch` sequences have prefilled `context` tokens and decode from here on."""
    config = EngineConfig(device=device, dtype=dtype, num_kv_blocks=1, max_num_seqs=batch, detokenize=False)
    config.num_kv_blocks = batch * -(-(context + max_tokens) // config.block_size)
    engine = LLMEngine.from_model_path(model, config)
    engine.warmup()
    vocab = engine.lm.config.vocab_size
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{i}", [(i * 7 + t) % (vocab - 3) + 3 for t in range(context)], sampling)
    while any(not s.is_prefill_done for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return engine


def timed(engine: LLMEngine, fn, rounds: int) -> float:
    """ms per round of fn(i), device work included."""
    _sync(engine)
    start = time.perf_counter()
    for i in range(rounds):
        fn(i)
    _sync(engine)
    return (time.perf_counter() - start) * 1000.0 / rounds


def measure(engine: LLMEngine, num_blocks: int, rounds: int) -> dict:
    """Copies out of the engine's pool (full blocks of its sequences: they no longer change) and in to
    a second pool of the same shape (no slot the engine may hand out), through its own KvCopier."""
    copier, kv = engine.copier, engine.runner.kv
    full = [b for s in engine.scheduler.running for b in s.block_ids[: s.num_computed_tokens // kv.block_size]]
    assert len(full) >= num_blocks, f"{len(full)} full blocks in the pool, {num_blocks} asked for"
    out_ids, in_ids = full[:num_blocks], list(range(num_blocks))
    expected = kv.read_blocks(out_ids)  # [M, *block_shape]
    incoming = expected.pin_memory() if copier.is_cuda else expected
    inward = KvCopier(engine.lm.model.make_kv_cache(num_blocks, kv.block_size, copier.device, dtype=kv.dtype))
    call_ms: list[float] = []
    last: list[OutCopy] = []

    def engine_call(fn, *args):
        started = time.perf_counter()
        result = fn(*args)
        call_ms.append((time.perf_counter() - started) * 1000.0)
        return result

    def copies(i: int) -> None:
        inward.write(in_ids, inward.stage(incoming))
        copier.copy_out(out_ids).wait()

    staged = [inward.stage(incoming)]

    def both(i: int) -> None:
        last[:] = [engine_call(copier.copy_out, out_ids)]
        engine_call(inward.write, in_ids, staged.pop())  # staged while the previous step ran
        staged.append(inward.stage(incoming))  # the I/O side stages the next blocks as this step runs
        engine.step()

    steps_ms = timed(engine, lambda i: engine.step(), rounds)
    copies_ms = timed(engine, copies, rounds)
    both_ms = timed(engine, both, rounds)
    identical = torch.equal(last[0].wait(), expected) and torch.equal(inward.copy_out(in_ids).wait(), expected)
    block_mb = incoming[0].numel() * incoming.element_size() / 2**20
    return {
        "blocks_per_copy": num_blocks,
        "mb_per_direction": round(num_blocks * block_mb, 2),
        "step_ms": round(steps_ms, 3),
        "copies_ms": round(copies_ms, 3),
        "both_ms": round(both_ms, 3),
        "overlap": round((steps_ms + copies_ms - both_ms) / min(steps_ms, copies_ms), 3) if copier.is_cuda else None,
        "engine_thread_ms_per_copy_call": round(sum(call_ms) / len(call_ms), 3),
        "pcie_gb_s": round(2 * num_blocks * block_mb / 1024 / (copies_ms / 1000.0), 2),
        "byte_identical": bool(identical),
        "unpinned_copies": copier.num_unpinned_copies,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=256, help="blocks per copy, each direction")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    max_tokens = 3 * args.rounds + 16
    engine = decoding_engine(args.model, args.device, args.dtype, args.batch, args.context, max_tokens)
    result = {"device": args.device, "batch": args.batch, "context": args.context}
    result |= measure(engine, args.blocks, args.rounds)
    is_cuda = engine.copier.is_cuda
    # on a GPU the copies must hide behind the steps, and the engine thread must not wait for them
    hidden = is_cuda and result["overlap"] >= 0.5
    not_waited = result["engine_thread_ms_per_copy_call"] < 0.25 * result["copies_ms"]
    result["passed"] = result["byte_identical"] and (not is_cuda or (hidden and not_waited))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
