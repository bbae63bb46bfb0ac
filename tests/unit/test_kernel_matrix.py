"""Every Triton kernel against the plain-torch reference across the shapes a real model has: head dims
64/80/128, block sizes 16/32/64, GQA groups 1..8, fp32/fp16/bf16, and a KV cache whose dtype differs
from the model's (bf16 under fp32, fp32 under bf16). Under TRITON_INTERPRET=1 on the CPU (bf16 dots
widened to fp32 there, see triton_decode.upcast_dots); natively where CUDA is present."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # before the kernels are defined (see test_kernels.py)
    os.environ["TRITON_INTERPRET"] = "1"

from ferry.kernels import attention_ref as ref  # noqa: E402
from ferry.kernels.triton_decode import gqa_decode_attention, mla_decode_attention  # noqa: E402
from ferry.kernels.triton_prefill import varlen_prefill_attention  # noqa: E402
from ferry.model import AttentionMetadata  # noqa: E402

pytestmark = pytest.mark.unit
DEVICE = "cuda" if HAS_CUDA else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOLERANCE = {F32: 2e-5, F16: 4e-3, BF16: 3e-2}
# (head dim, model dtype, cache dtype, GQA group, block size): every dim x dtype, groups and block sizes
# rotated across them, then the mixed-dtype caches
SHAPES = [
    (dim, dtype, dtype, group, block)
    for (dim, dtype), (group, block) in zip(
        itertools.product((64, 80, 128), (F32, F16, BF16)), itertools.cycle([(1, 16), (4, 32), (8, 64), (2, 16)])
    )
] + [(64, F32, BF16, 2, 16), (128, F32, BF16, 4, 32), (80, BF16, F32, 2, 16), (64, F16, BF16, 4, 16)]
IDS = [f"d{d}-{str(m)[6:]}-kv{str(c)[6:]}-g{g}-bs{b}" for d, m, c, g, b in SHAPES]


def _paged(seq_lens, kv_heads, dim, block, dtype, gen):
    """Caches with shuffled block ids -> (tables, k_cache, v_cache) in dtype."""
    num_blocks = sum(-(-n // block) for n in seq_lens) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-n // block))] for n in seq_lens]
    k, v = (torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(DEVICE, dtype) for _ in "kv")
    return tables, k, v


def _close(got, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dim,dtype,kv_dtype,group,block", SHAPES, ids=IDS)
def test_gqa_decode(dim, dtype, kv_dtype, group, block):
    gen = torch.Generator().manual_seed(dim + group)
    kv_heads, seq_lens = 2, [1, block + 3, 3 * block - 5]
    tables, k, v = _paged(seq_lens, kv_heads, dim, block, kv_dtype, gen)
    meta = AttentionMetadata.build([1] * 3, [n - 1 for n in seq_lens], tables, block, DEVICE)
    q = torch.randn(3, kv_heads * group, dim, generator=gen).to(DEVICE, dtype)
    got = gqa_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, dim**-0.5)
    assert got.dtype == dtype
    expected = ref.paged_decode_attention(q.float(), k.float(), v.float(), meta.block_tables, meta.seq_lens, dim**-0.5)
    _close(got, expected, dtype)


@pytest.mark.parametrize("dim,dtype,kv_dtype,group,block", SHAPES, ids=IDS)
def test_varlen_prefill(dim, dtype, kv_dtype, group, block):
    gen = torch.Generator().manual_seed(dim * group)
    kv_heads, query_lens, context_lens = 1, [5, 1, 20], [0, block, block + 7]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    tables, k, v = _paged(seq_lens, kv_heads, dim, block, kv_dtype, gen)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block, DEVICE)
    q = torch.randn(sum(query_lens), kv_heads * group, dim, generator=gen).to(DEVICE, dtype)
    window = 9 if group == 2 else None
    got = varlen_prefill_attention(
        q, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(query_lens), dim**-0.5, window
    )
    assert got.dtype == dtype
    for i, (start, end) in enumerate(zip(meta.query_starts, meta.query_starts[1:])):
        keys = ref.gather_seq(k, meta.block_tables[i], seq_lens[i]).float()
        values = ref.gather_seq(v, meta.block_tables[i], seq_lens[i]).float()
        expected = ref.prefill_attention(q[start:end].float(), keys, values, context_lens[i], dim**-0.5, window)
        _close(got[start:end], expected, dtype)


@pytest.mark.parametrize(
    "dtype,kv_dtype,block", [(F32, F32, 16), (F16, F16, 32), (BF16, BF16, 16), (F32, BF16, 64)], ids=str
)
def test_mla_decode(dtype, kv_dtype, block):
    gen = torch.Generator().manual_seed(block)
    rank, rope, heads, seq_lens = 64, 16, 20, [3, 2 * block + 1]
    tables, cache, _ = _paged(seq_lens, 1, rank + rope, block, kv_dtype, gen)
    meta = AttentionMetadata.build([1] * 2, [n - 1 for n in seq_lens], tables, block, DEVICE)
    q = torch.randn(2, heads, rank + rope, generator=gen).to(DEVICE, dtype)
    got = mla_decode_attention(q, cache, rank, meta.block_tables, meta.seq_lens, 0.1)
    c = cache.float()
    expected = ref.paged_decode_attention(q.float(), c, c[..., :rank], meta.block_tables, meta.seq_lens, 0.1)
    _close(got, expected, dtype)
