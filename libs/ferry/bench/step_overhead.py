"""Engine per-step overhead: LLMEngine.step() with the model forward replaced by a constant.

What is left is everything outside the model: scheduler, block manager, AttentionMetadata.build,
input tensors, sampler, detokenizer, output objects. Dynamic batching, bench model, 1 thread,
256 seeded requests (shared/BENCHMARKS.md workload), greedy, exact lengths.

    python -m ferry.bench.step_overhead MODEL CAP [detok|nodetok] [REPS]
    PYTHONPATH=<an older checkout>/libs:libs python -m ferry.bench.step_overhead MODEL CAP detok  # another version
"""

import inspect
import statistics
import sys
import time
from typing import Any

import torch

import ferry
from ferry.bench.workload import WorkloadConfig, make_workload
from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import load_model
from ferry.protocol import SamplingParams


class _ConstantModel:
    """Stands in for lm.model: the runner still builds every input; the forward costs nothing."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.model = lambda ids, pos, meta, kv: logits[: meta.num_seqs]  # [B, V]


def main() -> None:
    torch.set_num_threads(1)
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    model, cap = sys.argv[1], int(sys.argv[2])
    detok = len(sys.argv) < 4 or sys.argv[3] != "nodetok"
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    lm = load_model(model)
    kw: dict[str, Any] = dict(num_kv_blocks=4096, max_num_seqs=cap, max_num_batched_tokens=2048)
    if "detokenize" in inspect.signature(EngineConfig).parameters:
        kw["detokenize"] = detok
    elif not detok:
        sys.exit("this engine has no detokenize option")
    shim = _ConstantModel(torch.randn(256, lm.config.vocab_size))
    full_ms = []
    for rep in range(reps):
        engine = LLMEngine(lm, EngineConfig(**kw))
        engine.runner.lm = shim
        for r in make_workload(WorkloadConfig(num_requests=256, vocab_size=2048, seed=rep)):
            engine.add_request(
                str(r.index),
                r.prompt_token_ids,
                SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True),
            )
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            outputs = engine.step()
            if len(outputs) == cap:  # a full batch, every member sampling a token
                full_ms.append((time.perf_counter() - started) * 1000)
    print(
        f"cap {cap} detokenize={detok} ({ferry.__file__}): full-batch step median "
        f"{statistics.median(full_ms):.3f} ms over {len(full_ms)} steps"
    )


if __name__ == "__main__":
    main()
