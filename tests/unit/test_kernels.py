"""Triton kernels vs the plain-torch reference, under TRITON_INTERPRET=1 on CPU (small shapes),
and natively when CUDA is present (marked gpu)."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # must be set before the kernels are defined: they then run on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"

from ferry.kernels import attention_ref as ref  # noqa: E402
from ferry.kernels.triton_decode import gqa_decode_attention, mla_decode_attention  # noqa: E402
from ferry.kernels.triton_prefill import varlen_prefill_attention  # noqa: E402
from ferry.model import AttentionMetadata  # noqa: E402

pytestmark = pytest.mark.unit
BLOCK = 16
# One process either interprets the kernels (CPU tensors) or compiles them for the GPU, not both.
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="compiled for CUDA here; cuda runs")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]


def _paged(seq_lens: list[int], heads: int, dim: int, gen: torch.Generator, device: str):
    """A cache with shuffled block ids, each sequence filled with random K/V."""
    num_blocks = sum((n + BLOCK - 1) // BLOCK for n in seq_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, k = [], torch.randn(num_blocks, BLOCK, heads, dim, generator=gen)
    for n in seq_lens:
        tables.append([order.pop() for _ in range((n + BLOCK - 1) // BLOCK)])
    return tables, k.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(4, 2, 16, None), (6, 1, 24, None), (4, 4, 16, 20)])
def test_gqa_decode_matches_reference(device, heads, kv_heads, dim, window):
    gen = torch.Generator().manual_seed(heads * dim)
    seq_lens = [1, 17, 40, 33]
    tables, k_cache = _paged(seq_lens, kv_heads, dim, gen, device)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(device)
    meta = AttentionMetadata.build([1] * 4, [n - 1 for n in seq_lens], tables, BLOCK, device)
    q = torch.randn(4, heads, dim, generator=gen).to(device)
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, dim**-0.5, window)
    torch.testing.assert_close(gqa_decode_attention(*args), ref.paged_decode_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_mla_decode_matches_reference(device):
    gen = torch.Generator().manual_seed(0)
    rank, rope, heads = 32, 8, 20  # heads span two blocks of 16
    seq_lens = [5, 50, 16]
    tables, cache = _paged(seq_lens, 1, rank + rope, gen, device)
    meta = AttentionMetadata.build([1] * 3, [n - 1 for n in seq_lens], tables, BLOCK, device)
    q = torch.randn(3, heads, rank + rope, generator=gen).to(device)
    expected = ref.paged_decode_attention(q, cache, cache[..., :rank], meta.block_tables, meta.seq_lens, 0.3)
    got = mla_decode_attention(q, cache, rank, meta.block_tables, meta.seq_lens, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 10])
def test_varlen_prefill_matches_reference(device, window):
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 4, 2, 16
    query_lens, context_lens = [7, 1, 40, 18], [0, 9, 0, 21]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    tables, k_cache = _paged(seq_lens, kv_heads, dim, gen, device)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(device)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK, device)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen).to(device)
    got = varlen_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(query_lens), dim**-0.5, window
    )
    for i, (start, end) in enumerate(zip(meta.query_starts, meta.query_starts[1:])):
        k = ref.gather_seq(k_cache, meta.block_tables[i], seq_lens[i])
        v = ref.gather_seq(v_cache, meta.block_tables[i], seq_lens[i])
        expected = ref.prefill_attention(q[start:end], k, v, context_lens[i], dim**-0.5, window)
        torch.testing.assert_close(got[start:end], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(HAS_CUDA, reason="checks run before launch; CPU tensors here")
def test_wrappers_reject_bad_shapes():
    q = torch.randn(2, 4, 16)
    cache = torch.randn(4, BLOCK, 2, 16)
    tables, lens = torch.zeros(2, 1, dtype=torch.int64), torch.tensor([3, 4])
    with pytest.raises(ValueError, match="block_tables"):
        gqa_decode_attention(q, cache, cache, tables[:1], lens, 1.0)
    with pytest.raises(ValueError, match="cache"):
        gqa_decode_attention(q, cache.double(), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="q"):
        gqa_decode_attention(q.transpose(1, 2), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="cache"):
        mla_decode_attention(q, cache, 8, tables, lens, 1.0)


@pytest.mark.parametrize("arch", ["mistral", "deepseek-v3"])
def test_model_through_kernels_matches_torch_path(arch, tmp_path):
    """The whole model, a mixed prefill/decode batch, with the 'triton' vs the 'torch' attention backend."""
    from ferry.model import load_model
    from ferry.model.make_model import make_model

    device = "cuda" if HAS_CUDA else "cpu"
    lm = load_model(make_model(tmp_path, arch, "tiny", seed=2), device=device)
    gen = torch.Generator().manual_seed(5)
    logits = {}
    for mode in ("torch", "triton"):
        lm.model.set_attention_backend(mode)
        kv = lm.model.make_kv_cache(16, BLOCK)
        tables = [[3, 4, 5], [6], [7, 8, 9]]
        steps = [([30, 9, 20], [0, 0, 0]), ([1, 1, 12], [30, 9, 20]), ([1, 1, 1], [31, 10, 32])]
        logits[mode] = []
        for query_lens, context_lens in steps:
            gen.manual_seed(len(logits[mode]))
            meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK, device)
            ids = torch.randint(0, 500, (sum(query_lens),), generator=gen).to(device)
            pos = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)]).to(device)
            logits[mode].append(lm.model(ids, pos, meta, kv))
    for ours, reference in zip(logits["triton"], logits["torch"]):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
