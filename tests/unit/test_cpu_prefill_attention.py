"""The C++ prefill attention of whole prompts (ferry.kernels.cpu_prefill) against the plain-torch reference
(attention_ref.prefill_attention: repeat_interleave + SDPA), fp32 and bf16, GQA and MHA, and in the model."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import attention_ref as ref
from ferry.kernels import cpu_decode, cpu_prefill

pytestmark = pytest.mark.unit
LENGTHS = [1, 17, 64, 65, 600]
HEADS = [(9, 3), (4, 4), (8, 1)]  # SmolLM2's GQA 3, MHA, MQA


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_decode.kernel() is not None, "the CPU kernels did not build (see the logged warning)"


def _qkv(length: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q/k/v as the engine hands them: views into one [L, H + 2 Hkv, D] projection output."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(length, heads + 2 * kv_heads, dim, generator=gen)
    return qkv.split([heads, kv_heads, kv_heads], dim=1)


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("dim", [64, 128])
def test_fp32_matches_reference(length, heads, kv_heads, dim):
    q, k, v = _qkv(length, heads, kv_heads, dim, seed=length + heads)
    got = cpu_prefill.prefill_attention(q, k, v, dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == (length, heads, dim)
    torch.testing.assert_close(got, ref.prefill_attention(q, k, v, 0, dim**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("length", LENGTHS)
def test_bf16_is_as_close_to_fp32_as_torchs_bf16_attention(length, heads, kv_heads):
    """bf16 q/k/v (VDPBF16PS where built, softmax weights rounded to bf16): against the fp32 attention of the same
    bf16 values, no further off than torch's own bf16 SDPA path (which rounds its output to bf16 too)."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(length, heads, kv_heads, 64, seed=3 * length + heads))
    exact = ref.prefill_attention(q.float(), k.float(), v.float(), 0, 0.125)
    got = cpu_prefill.prefill_attention(q, k, v, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == (length, heads, 64)
    ours = (got.float() - exact).abs().max().item()
    torchs = (ref.prefill_attention(q, k, v, 0, 0.125).float() - exact).abs().max().item()
    assert ours <= 2 * torchs + 2e-3, (ours, torchs)
    assert ours < 0.02


def test_strided_views_give_what_contiguous_copies_give():
    q, k, v = _qkv(150, 9, 3, 64, seed=1)
    assert not q.is_contiguous()
    strided = cpu_prefill.prefill_attention(q, k, v, 0.125)
    assert torch.equal(strided, cpu_prefill.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125))


def test_rows_do_not_depend_on_threads_or_later_tokens():
    """Causal: a prompt's first 40 tokens attend exactly as the 40-token prompt alone does, on 1 thread or 2."""
    q, k, v = _qkv(200, 9, 3, 64, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = cpu_prefill.prefill_attention(q, k, v, 0.125)
        torch.set_num_threads(1)
        prefix = cpu_prefill.prefill_attention(q[:40], k[:40], v[:40], 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole[:40], prefix)


def test_usable_only_for_what_the_kernel_takes(monkeypatch):
    q, k, v = _qkv(8, 4, 2, 64, seed=0)
    assert cpu_prefill.prefill_usable(q, k, v, None)
    assert not cpu_prefill.prefill_usable(q, k, v, 4)  # sliding window
    assert not cpu_prefill.prefill_usable(q.half(), k.half(), v.half(), None)
    assert not cpu_prefill.prefill_usable(q, k.to(torch.bfloat16), v, None)  # mixed dtypes
    q40, k40, v40 = _qkv(8, 4, 2, 40, seed=0)
    assert not cpu_prefill.prefill_usable(q40, k40, v40, None)  # head size not a multiple of 16
    monkeypatch.setattr(cpu_prefill, "PREFILL_ATTN_CPP", False)
    assert not cpu_prefill.prefill_usable(q, k, v, None)


def test_model_prefill_with_kernel_matches_reference_path(tmp_path, monkeypatch):
    """The tiny model's whole prompts (and a following chunk and decode step) with FERRY_PREFILL_ATTN_CPP on vs
    off; on, the kernel runs."""
    from ferry.kernels import resolve_attention
    from ferry.model import AttentionMetadata, load_model
    from ferry.model.make_model import make_model

    lm = load_model(make_model(tmp_path, "llama", "tiny", seed=3))
    lm.model.set_attention_backend(resolve_attention("cpu"))
    calls = []
    kernel_call = cpu_prefill.prefill_attention
    monkeypatch.setattr(cpu_prefill, "prefill_attention", lambda *a: calls.append(1) or kernel_call(*a))
    logits = {}
    for switch in (True, False):
        monkeypatch.setattr(cpu_prefill, "PREFILL_ATTN_CPP", switch)
        kv, gen = lm.model.make_kv_cache(16, 16, dtype=torch.float32), torch.Generator().manual_seed(5)
        tables = [[3, 4, 5], [6], [7, 8, 9]]
        logits[switch] = []
        for query_lens, context_lens in (([30, 9, 20], [0, 0, 0]), ([1, 1, 12], [30, 9, 20])):
            meta = AttentionMetadata.build(query_lens, context_lens, tables, 16)
            ids = torch.randint(0, 500, (sum(query_lens),), generator=gen)
            pos = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
            logits[switch].append(lm.model(ids, pos, meta, kv))
    assert calls, "the kernel never ran"
    for ours, reference in zip(logits[True], logits[False]):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
