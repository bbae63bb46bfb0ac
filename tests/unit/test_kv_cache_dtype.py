"""EngineConfig.kv_cache_dtype: a bf16 KV cache under an fp32 model (CPU). The pool holds twice the
blocks per GiB, blocks live in their own KV-store namespace, a hand-off between two bf16 engines
continues exactly, and the logits stay close to the fp32 cache's."""

from __future__ import annotations

import pytest
import torch
from engine_steps import run_to_end

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import AttentionMetadata, load_model
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = [(7 * i + 5) % 250 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    yield load_model(make_model(tmp_path_factory.mktemp("kv-dtype") / "tiny", "llama", "tiny"))


def test_an_unknown_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_dtype='int8': must be None or one of"):
        EngineConfig(kv_cache_dtype="int8")


def test_bf16_cache_doubles_the_pool_and_gets_its_own_namespace(lm):
    fp32 = LLMEngine(lm, EngineConfig(kv_cache_memory_gb=0.01))
    bf16 = LLMEngine(lm, EngineConfig(kv_cache_memory_gb=0.01, kv_cache_dtype="bfloat16"))
    assert bf16.runner.kv.dtype == torch.bfloat16 and fp32.runner.kv.dtype == torch.float32
    assert bf16.block_manager.num_blocks // 2 == fp32.block_manager.num_blocks  # the same GiB, floored
    assert fp32.kv_namespace == lm.fingerprint
    assert bf16.kv_namespace == f"{lm.fingerprint}-kv-bfloat16"
    same = LLMEngine(lm, EngineConfig(num_kv_blocks=8, kv_cache_dtype="float32"))  # the model's own dtype
    assert same.kv_namespace == lm.fingerprint


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["fused", "reference"])
def test_a_hand_off_between_bf16_engines_continues_exactly(lm, kernels, monkeypatch):
    monkeypatch.setenv("FERRY_CPU_KERNELS", kernels)
    config = EngineConfig(num_kv_blocks=32, kv_cache_dtype="bfloat16")
    alone = LLMEngine(lm, config)
    alone.add_request("a", PROMPT, GREEDY)
    expected = run_to_end(alone, "a")

    prefill = LLMEngine(lm, EngineConfig(num_kv_blocks=32, kv_cache_dtype="bfloat16", role="prefill"))
    prefill.add_request("a", PROMPT, GREEDY)
    first = run_to_end(prefill, "a")
    kv = prefill.take_prefilled("a")
    assert kv.data.dtype == torch.bfloat16
    decode = LLMEngine(lm, config)
    decode.add_prefilled("a", PROMPT, first, GREEDY, kv.data, kv.num_tokens)
    assert first + run_to_end(decode, "a") == expected


@pytest.mark.parametrize("arch", ["llama", "deepseek-v3"])
def test_bf16_cache_logits_stay_close_to_the_fp32_caches(arch, tmp_path):
    """Prefill then three decode steps: only the cached K/V are rounded (once), the math stays fp32."""
    model = load_model(make_model(tmp_path, arch, "tiny", seed=3))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 500, (2, 40), generator=gen)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        kv, tables, out = model.model.make_kv_cache(16, 16, dtype=dtype), [[0, 1, 2, 3], [4, 5, 6, 7]], []
        meta = AttentionMetadata.build([40, 40], [0, 0], tables, 16)
        out.append(model.model(prompt.flatten(), torch.arange(40).repeat(2), meta, kv))
        for step in range(3):
            meta = AttentionMetadata.build([1, 1], [40 + step] * 2, tables, 16)
            out.append(model.model(out[-1].argmax(-1), torch.full((2,), 40 + step), meta, kv))
        logits[dtype] = torch.stack(out)
    scale = logits[torch.float32].abs().max()
    error = (logits[torch.bfloat16] - logits[torch.float32]).abs().max()
    assert error < 0.02 * scale, f"bf16 cache moved the logits by {error:.4f} (largest logit {scale:.3f})"
    assert torch.equal(logits[torch.bfloat16][0], logits[torch.float32][0])  # prefill reads no cached K/V


def test_quantized_weights_on_the_cpu_default_to_a_bf16_cache_and_float32_opts_out(lm, tmp_path):
    """Unset, the cache of an fp32 model with int8/int4 weights on the CPU is bf16 (its numerics are already
    the codes'; decode attention reads half the bytes), with its own namespace; an fp32-weight model keeps
    its own dtype, and an explicit 'float32' keeps fp32 under quantized weights."""
    q = load_model(lm.path, weights_dtype="int8")
    default = LLMEngine(q, EngineConfig(num_kv_blocks=8))
    assert default.runner.kv.dtype == torch.bfloat16 and default.kv_cache_dtype == "bfloat16"
    assert default.kv_namespace == f"{q.fingerprint}-kv-bfloat16"
    assert LLMEngine(lm, EngineConfig(num_kv_blocks=8)).runner.kv.dtype == torch.float32
    opted_out = LLMEngine(q, EngineConfig(num_kv_blocks=8, kv_cache_dtype="float32"))
    assert opted_out.runner.kv.dtype == torch.float32 and opted_out.kv_namespace == q.fingerprint
    by_memory = LLMEngine(q, EngineConfig(kv_cache_memory_gb=0.01))
    fp32_pool = LLMEngine(q, EngineConfig(kv_cache_memory_gb=0.01, kv_cache_dtype="float32"))
    assert by_memory.block_manager.num_blocks // 2 == fp32_pool.block_manager.num_blocks  # the same GiB, floored
