"""EngineConfig.kv_cache_dtype='float8_e4m3fn': an fp8 KV cache on the CPU. The fused write rounds as torch does,
the fused decode kernel widens every code exactly and matches the plain-torch path, the pool holds four times
fp32's blocks under its own KV-store namespace, hand-offs and the host tier move its bytes unchanged, the GPU
paths refuse it by name, and on SmolLM2 its next-token predictions stay close to the bf16 cache's."""

from __future__ import annotations

import pytest
import torch
from engine_steps import run_to_end

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.kernels import attention_ref as ref
from ferry.kernels import cpu_decode
from ferry.kernels.cpu_layers import write_kv
from ferry.model import load_model
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = [(7 * i + 5) % 250 + 3 for i in range(40)]
SMOLLM2_AGREEMENT = 0.95
"""Teacher-forced argmax agreement of fp8 vs bf16 KV on SmolLM2 as served measured 0.971 (mean KL 0.004 nats,
ops/bench/throughput/reports/20261205-kv8); the bar leaves two points of margin."""


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    yield load_model(make_model(tmp_path_factory.mktemp("kv-fp8") / "tiny", "llama", "tiny"))


@pytest.fixture(scope="module")
def kernel():
    assert cpu_decode.kernel() is not None, "the fused CPU kernels did not build (see the logged warning)"


def test_fused_write_rounds_and_saturates_as_torch_does(kernel):
    values = torch.randn(10, 3, 64, generator=torch.Generator().manual_seed(0)) * 100
    edges = [1e-3, 3e-3, 600.0, -1000.0, 447.0, -0.0, 470.0, 2**-10, 3 * 2**-11, 0.0156, float("inf"), float("nan")]
    values[0, 0, : len(edges)] = torch.tensor(edges)  # subnormals and their ties, saturation, infinity, NaN
    values[1] = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 0.01  # mostly subnormal
    slots = torch.arange(10) * 3
    fused, torch_path = (torch.zeros(4, 16, 3, 64, dtype=FP8) for _ in "ab")
    write_kv(fused, slots, values)
    ref.write_kv(torch_path, slots, values)
    assert torch.equal(fused.view(torch.uint8), torch_path.view(torch.uint8))
    assert fused.flatten(0, 1)[0, 0, 2].float() == 448 and fused.flatten(0, 1)[0, 0, 3].float() == -448


def test_the_kernel_widens_every_code_exactly(kernel):
    """A sequence of one token attends only to it: the output is its value row, widened. Four sequences' value
    rows hold all 254 non-NaN codes."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] + [0, 0], dtype=torch.uint8)
    v = torch.zeros(4, 16, 1, 64, dtype=torch.uint8)
    v[:, 0, 0] = codes.view(4, 64)
    v, k = v.view(FP8), torch.zeros(4, 16, 1, 64, dtype=FP8)
    out = cpu_decode.fused_paged_decode_attention(
        torch.randn(4, 2, 64), k, v, torch.arange(4).view(4, 1), torch.ones(4, dtype=torch.int64), 0.125
    )  # [4, 2, 64]
    expected = v[:, 0, 0].float()  # torch's widening
    assert torch.equal(out[:, 0], expected) and torch.equal(out[:, 1], expected)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("group", [1, 3])
def test_fused_decode_matches_the_torch_path_on_an_fp8_cache(kernel, group, window):
    gen = torch.Generator().manual_seed(group)
    lens = [1, 15, 17, 300]
    tables = torch.randperm(90, generator=gen)[:80].view(4, 20)
    # head-major, as PagedKVCache stores it; values up to the saturation range and below the normal range
    k, v = ((torch.randn(2, 90, 16, 64, generator=gen) * 4).to(FP8).permute(1, 2, 0, 3) for _ in "kv")
    q = torch.randn(4, 2 * group, 64, generator=gen)
    got = cpu_decode.fused_paged_decode_attention(q, k, v, tables, torch.tensor(lens), 0.125, window)
    want = ref.paged_decode_attention(q, k, v, tables, torch.tensor(lens), 0.125, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp8_quarters_fp32_per_block_and_gets_its_own_namespace(lm):
    fp32 = LLMEngine(lm, EngineConfig(kv_cache_memory_gb=0.01))
    fp8 = LLMEngine(lm, EngineConfig(kv_cache_memory_gb=0.01, kv_cache_dtype="float8_e4m3fn"))
    assert fp8.runner.kv.dtype == FP8 and fp8.kv_cache_dtype == "float8_e4m3fn"
    assert fp8.block_manager.num_blocks // 4 == fp32.block_manager.num_blocks  # the same GiB, floored
    assert fp8.kv_namespace == f"{lm.fingerprint}-kv-float8_e4m3fn"


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["fused", "reference"])
def test_a_hand_off_between_fp8_engines_continues_exactly(lm, kernels, monkeypatch):
    """The prefill engine's fp8 blocks, read out and written into another pool (raw bytes: torch has no fp8
    index_copy_), give the same tokens as one engine doing both; prefill, chunked context and decode read fp8."""
    monkeypatch.setenv("FERRY_CPU_KERNELS", kernels)
    config = EngineConfig(num_kv_blocks=32, kv_cache_dtype="float8_e4m3fn", max_num_seqs=4, max_num_batched_tokens=24)
    alone = LLMEngine(lm, config)  # 24-token budget: the 40-token prompt prefills in two chunks
    alone.add_request("a", PROMPT, GREEDY)
    expected = run_to_end(alone, "a")

    prefill = LLMEngine(lm, EngineConfig(num_kv_blocks=32, kv_cache_dtype="float8_e4m3fn", role="prefill"))
    prefill.add_request("a", PROMPT, GREEDY)
    first = run_to_end(prefill, "a")
    kv = prefill.take_prefilled("a")
    assert kv.data.dtype == FP8
    decode = LLMEngine(lm, config)
    decode.add_prefilled("a", PROMPT, first, GREEDY, kv.data, kv.num_tokens)
    assert first + run_to_end(decode, "a") == expected


def test_host_tier_brings_fp8_blocks_back(lm):
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt, other = PROMPT[:32] + [7] * 33, [(5 * i + 11) % 250 + 3 for i in range(65)]
    config = EngineConfig(num_kv_blocks=6, max_num_seqs=2, host_cache_blocks=16, kv_cache_dtype="float8_e4m3fn")
    eng = LLMEngine(lm, config)
    eng.add_request("a", prompt, first)
    expected = run_to_end(eng, "a")
    eng.add_request("b", other, first)
    run_to_end(eng, "b")  # evicts a's blocks into the host tier
    eng.add_request("c", prompt, first)
    assert run_to_end(eng, "c") == expected
    assert eng.stats().num_host_hit_blocks > 0


@pytest.mark.parametrize("device,attention", [("cuda", None), ("cpu", "triton")], ids=["gpu", "triton-on-cpu"])
def test_the_gpu_paths_refuse_fp8_by_name(device, attention):
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_dtype='float8_e4m3fn': runs on the CPU only"):
        EngineConfig(kv_cache_dtype="float8_e4m3fn", device=device, attention=attention)


def test_the_worker_setting_takes_fp8_and_refuses_other_names():
    from services.worker.settings import WorkerSettings

    assert WorkerSettings(kv_cache_dtype="float8_e4m3fn").kv_cache_dtype == "float8_e4m3fn"
    with pytest.raises(ValueError, match="kv_cache_dtype: unsupported 'float8_e5m2'"):
        WorkerSettings(kv_cache_dtype="float8_e5m2")


def test_smollm2_with_fp8_kv_predicts_as_with_bf16_kv():
    """Teacher-forced on the quant bench's fixed 256-token text, the served model (its GGUF's int4/int8 codes)
    through an fp8 cache against a bf16 cache: every decode step reads the cached K/V."""
    from ferry.bench.quant_decode import QUALITY_TEXT, agreement, cached_decode_logits
    from ferry.model.source import DEFAULT_MODEL

    threads = torch.get_num_threads()
    served = load_model(DEFAULT_MODEL, weights_dtype="auto")
    torch.set_num_threads(threads)
    ids = served.tokenizer.encode(QUALITY_TEXT)[:256]
    got = agreement(cached_decode_logits(served, ids, torch.bfloat16), cached_decode_logits(served, ids, FP8))
    assert got["argmax_equal_rate"] >= SMOLLM2_AGREEMENT and got["mean_kl"] < 0.02, got
