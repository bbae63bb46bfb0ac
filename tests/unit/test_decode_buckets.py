"""CPU decode attention groups sequences into length buckets; every bucket layout gives the same answer."""

import pytest
import torch

from ferry.kernels import attention_ref as ref

pytestmark = pytest.mark.unit


def _naive(q, k_cache, v_cache, tables, seq_lens, scale, window):
    """One sequence at a time, straight from the definition."""
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        k = ref.gather_seq(k_cache, tables[i], n)  # [n, Hkv, D]
        v = ref.gather_seq(v_cache, tables[i], n)
        outs.append(ref.prefill_attention(q[i : i + 1], k, v, n - 1, scale, window))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 20])
def test_bucketed_decode_matches_per_sequence_attention(window):
    g = torch.Generator().manual_seed(0)
    bs, heads, kv_heads, dim = 4, 4, 2, 8
    seq_lens = torch.tensor([3, 150, 17, 160, 5, 90, 155, 4])
    blocks = (seq_lens.max().item() + bs - 1) // bs
    k_cache = torch.randn(len(seq_lens) * blocks, bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(len(seq_lens) * blocks, bs, kv_heads, dim, generator=g)
    tables = torch.randperm(len(seq_lens) * blocks, generator=g).view(len(seq_lens), blocks)
    q = torch.randn(len(seq_lens), heads, dim, generator=g)
    plan = ref.decode_plan(tables, seq_lens, bs, window)
    assert len(plan) > 1 and sorted(torch.cat([b.rows for b in plan]).tolist()) == list(range(len(seq_lens)))
    got = ref.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, window, plan)
    torch.testing.assert_close(got, _naive(q, k_cache, v_cache, tables, seq_lens, 0.3, window))


def test_length_groups_split_only_when_padding_outweighs_overhead():
    assert ref._length_groups([5, 5, 5], 16) == [(3, 5)]
    assert ref._length_groups([1, 2, 1], 16) == [(3, 2)]  # saving 16 slots is not worth a bucket
    assert ref._length_groups([1, 40, 1, 40], 16) == [(2, 1), (4, 40)]
