"""The fused C++ CPU decode kernel against the plain-torch reference (attention_ref), the model with the
kernel on vs off, bad input, and the fallback when the kernel cannot be built.

The kernel is compiled once per machine and cached (first run ~10-60 s); every test here shares that
one build through the process-wide cache in ferry.kernels.cpu_decode.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ferry.kernels import attention_ref as ref
from ferry.kernels import cpu_decode
from ferry.kernels.cpu_decode import fused_paged_decode_attention as fused

pytestmark = pytest.mark.unit
BS = 16
LENS = [1, 15, 16, 17, 300]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    op = cpu_decode.kernel()
    assert op is not None, "the fused CPU decode kernel did not build (see the logged warning)"
    return op


def _cache(num_blocks: int, kv_heads: int, dim: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """A logical [N, bs, Hkv, D] cache stored head-major (as PagedKVCache does) or token-major."""
    if layout == "head_major":
        return torch.randn(kv_heads, num_blocks, BS, dim, generator=gen).permute(1, 2, 0, 3)
    return torch.randn(num_blocks, BS, kv_heads, dim, generator=gen)


def _tables(lens: list[int], gen: torch.Generator, extra_cols: int = 2) -> tuple[torch.Tensor, int]:
    """Shuffled, non-contiguous block ids; rows padded past their length with valid ids, as the engine pads."""
    cols = max(-(-n // BS) for n in lens) + extra_cols
    num_blocks = len(lens) * cols + 5
    return torch.randperm(num_blocks, generator=gen)[: len(lens) * cols].view(len(lens), cols), num_blocks


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])
def test_fused_matches_reference(group, window, layout):
    gen = torch.Generator().manual_seed(group * 7 + (window or 0))
    kv_heads, dim = 2, 64
    tables, num_blocks = _tables(LENS, gen)
    k_cache, v_cache = (_cache(num_blocks, kv_heads, dim, layout, gen) for _ in "kv")
    q = torch.randn(len(LENS), kv_heads * group, dim, generator=gen)
    lens = torch.tensor(LENS)
    got = fused(q, k_cache, v_cache, tables, lens, 0.125, window)
    torch.testing.assert_close(
        got, ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window), atol=1e-5, rtol=1e-5
    )


def test_query_rows_of_a_wider_tensor_are_read_in_place_with_the_same_result():
    """The engine hands q as the first heads of each fused q|k|v row (a view, not copied): same bits as a copy."""
    gen = torch.Generator().manual_seed(5)
    kv_heads, group, dim = 2, 2, 64
    tables, num_blocks = _tables(LENS, gen)
    k_cache, v_cache = (_cache(num_blocks, kv_heads, dim, "head_major", gen) for _ in "kv")
    qkv = torch.randn(len(LENS), kv_heads * group + 2 * kv_heads, dim, generator=gen)
    q = qkv[:, : kv_heads * group]
    assert not q.is_contiguous()
    lens = torch.tensor(LENS)
    got = fused(q, k_cache, v_cache, tables, lens, 0.125, None)
    assert torch.equal(got, fused(q.contiguous(), k_cache, v_cache, tables, lens, 0.125, None))


@pytest.mark.parametrize("dim", [24, 80, 128])  # run-time sizes (remainder lanes) and the other compiled-in one
def test_fused_matches_reference_other_head_dims(dim):
    gen = torch.Generator().manual_seed(dim)
    tables, num_blocks = _tables(LENS, gen)
    k_cache, v_cache = (_cache(num_blocks, 2, dim, "head_major", gen) for _ in "kv")
    q, lens = torch.randn(len(LENS), 4, dim, generator=gen), torch.tensor(LENS)
    torch.testing.assert_close(
        fused(q, k_cache, v_cache, tables, lens, 0.3),
        ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3),
        atol=1e-5,
        rtol=1e-5,
    )


def test_mla_value_cache_is_a_prefix_slice_of_the_key_cache():
    """MLA: one shared head, keys = latent + rope part, values = the latent part (Dv < D)."""
    gen = torch.Generator().manual_seed(3)
    rank, rope = 64, 16
    tables, num_blocks = _tables(LENS, gen)
    cache = _cache(num_blocks, 1, rank + rope, "head_major", gen)  # [N, bs, 1, C+R]
    q, lens = torch.randn(len(LENS), 8, rank + rope, generator=gen), torch.tensor(LENS)
    got = fused(q, cache, cache[..., :rank], tables, lens, 0.1)
    assert got.shape == (len(LENS), 8, rank)
    torch.testing.assert_close(
        got, ref.paged_decode_attention(q, cache, cache[..., :rank], tables, lens, 0.1), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,group", [(64, 2), (128, 3), (24, 2)])  # compiled-in sizes, odd groups, remainders
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous_rows", "strided_elements"])
def test_reduced_precision_cache_accumulates_in_fp32(dtype, dim, group, strided):
    """bf16 rows are widened in registers (bf16_dot off) and fp16 / strided rows through a buffer: all equal fp32
    math on the same (rounded) values."""
    gen = torch.Generator().manual_seed(4 + dim + group)
    tables, num_blocks = _tables(LENS, gen)
    k_cache, v_cache = (_cache(num_blocks, 2, dim * (2 if strided else 1), "head_major", gen).to(dtype) for _ in "kv")
    if strided:
        k_cache, v_cache = k_cache[..., ::2], v_cache[..., ::2]
    q, lens = torch.randn(len(LENS), 2 * group, dim, generator=gen), torch.tensor(LENS)
    got = fused(q, k_cache, v_cache, tables, lens, 0.125, bf16_dot=False)
    expected = ref.paged_decode_attention(q, k_cache.float(), v_cache.float(), tables, lens, 0.125)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _has_avx512_bf16() -> bool:
    from pathlib import Path

    return " avx512_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False


def test_bf16_dot_path_is_built_where_the_cpu_has_avx512_bf16():
    """-march=native on a CPU with AVX512_BF16 must build the VDPBF16PS path (else it silently never runs)."""
    assert cpu_decode.decode_bf16_dot_built() == (_has_avx512_bf16() and cpu_decode.march() == "native")


BF16_DOT_LENS = [1, 2, 15, 16, 17, 31, 33, 300]  # odd tiles (a last token without a partner), partial blocks


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])  # runs of 3 query rows and the shorter last runs
@pytest.mark.parametrize("dim", [64, 128])
def test_bf16_dot_matches_reference_within_bf16_rounding(dim, group, window):
    """The VDPBF16PS path rounds q and the softmax weights to bf16 (8 significant bits, 2^-9 relative): measured
    ~1e-3 relative (Frobenius) error against fp32 math on the same cache values and at most ~6e-3 on one output,
    about half of what rounding K/V to bf16 costs against an fp32 cache (asserted below, on the same data)."""
    gen = torch.Generator().manual_seed(dim + group + (window or 0))
    tables, num_blocks = _tables(BF16_DOT_LENS, gen)
    k32, v32 = (_cache(num_blocks, 2, dim, "head_major", gen) for _ in "kv")
    k_cache, v_cache = k32.to(torch.bfloat16), v32.to(torch.bfloat16)
    q, lens = torch.randn(len(BF16_DOT_LENS), 2 * group, dim, generator=gen), torch.tensor(BF16_DOT_LENS)
    scale = dim**-0.5
    got = fused(q, k_cache, v_cache, tables, lens, scale, window, bf16_dot=True)
    exact = ref.paged_decode_attention(q, k_cache.float(), v_cache.float(), tables, lens, scale, window)
    fp32_cache = ref.paged_decode_attention(q, k32, v32, tables, lens, scale, window)
    torch.testing.assert_close(got, exact, atol=1e-2, rtol=1e-2)
    dot_error = ((got - exact).norm() / exact.norm()).item()
    cache_error = ((exact - fp32_cache).norm() / fp32_cache.norm()).item()
    assert dot_error < 2e-3 and dot_error < cache_error, (dot_error, cache_error)
    if cpu_decode.decode_bf16_dot_built():  # the path ran: the widening path gives other bits
        assert not torch.equal(got, fused(q, k_cache, v_cache, tables, lens, scale, window, bf16_dot=False))


@pytest.mark.parametrize("case", ["fp32_cache", "head_dim_80", "strided_elements", "mla_dv_below_d"])
def test_bf16_dot_leaves_other_caches_on_the_widening_path(case):
    """bf16_dot only changes bf16 caches of unit-stride rows and D = Dv in {64, 128}: every other cache gives the
    widening path's bits."""
    gen = torch.Generator().manual_seed(11)
    tables, num_blocks = _tables(LENS, gen)
    dim = 80 if case == "head_dim_80" else 64
    dtype = torch.float32 if case == "fp32_cache" else torch.bfloat16
    k_cache = _cache(num_blocks, 2, 2 * dim, "head_major", gen).to(dtype)
    v_cache = _cache(num_blocks, 2, 2 * dim, "head_major", gen).to(dtype)
    if case == "strided_elements":
        k_cache, v_cache = k_cache[..., ::2], v_cache[..., ::2]
    elif case == "mla_dv_below_d":
        k_cache, v_cache = k_cache[..., :dim], k_cache[..., : dim // 2]
    else:
        k_cache, v_cache = k_cache[..., :dim], v_cache[..., :dim]
    q, lens = torch.randn(len(LENS), 4, dim, generator=gen), torch.tensor(LENS)
    on, off = (fused(q, k_cache, v_cache, tables, lens, 0.125, bf16_dot=flag) for flag in (True, False))
    assert torch.equal(on, off)


@pytest.mark.parametrize("batch", [0, 1])
def test_tiny_batches(batch):
    gen = torch.Generator().manual_seed(batch)
    tables, num_blocks = _tables([37] * batch or [1], gen)
    tables, lens = tables[:batch], torch.full((batch,), 37)
    k_cache, v_cache = (_cache(num_blocks, 2, 64, "head_major", gen) for _ in "kv")
    q = torch.randn(batch, 4, 64, generator=gen)
    got = fused(q, k_cache, v_cache, tables, lens, 0.125)
    assert got.shape == (batch, 4, 64)
    torch.testing.assert_close(
        got, ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    "kv_dtype,bf16_dot", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)  # bf16_dot: the VDPBF16PS path where built
def test_each_row_is_independent_of_the_rest_of_the_batch_and_of_threads(kv_dtype, bf16_dot):
    """Batch invariance: a sequence's output is bit-identical alone, in a batch, on 1 or 2 threads."""
    gen = torch.Generator().manual_seed(6)
    tables, num_blocks = _tables(LENS, gen)
    k_cache, v_cache = (_cache(num_blocks, 2, 64, "head_major", gen).to(kv_dtype) for _ in "kv")
    q, lens = torch.randn(len(LENS), 4, 64, generator=gen), torch.tensor(LENS)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = fused(q, k_cache, v_cache, tables, lens, 0.125, bf16_dot=bf16_dot)
        torch.set_num_threads(1)
        alone = [
            fused(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], 0.125, bf16_dot=bf16_dot)
            for i in range(len(LENS))
        ]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, torch.cat(alone))


def test_bad_input_raises_value_error_naming_the_field():
    gen = torch.Generator().manual_seed(7)
    tables, num_blocks = _tables([40, 40], gen, extra_cols=0)  # 3 blocks = 48 tokens per row
    k_cache, v_cache = (_cache(num_blocks, 2, 64, "head_major", gen) for _ in "kv")
    q, lens = torch.randn(2, 4, 64, generator=gen), torch.tensor([40, 40])
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 49"):
        fused(q, k_cache, v_cache, tables, torch.tensor([40, 49]), 0.125)
    with pytest.raises(ValueError, match="seq_lens"):
        fused(q, k_cache, v_cache, tables, torch.tensor([40, 0]), 0.125)
    with pytest.raises(ValueError, match=r"block_tables\[0, 2\] = .* outside"):
        fused(q, k_cache, v_cache, torch.cat([tables[:, :2], torch.full((2, 1), num_blocks)], 1), lens, 0.125)
    with pytest.raises(ValueError, match="block_tables: expected int64"):
        fused(q, k_cache, v_cache, tables.int(), lens, 0.125)
    with pytest.raises(ValueError, match="k_cache/v_cache: dtypes"):
        fused(q, k_cache.double(), v_cache.double(), tables, lens, 0.125)
    with pytest.raises(ValueError, match="q: expected a floating"):
        fused(q.long(), k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match="heads must be a multiple"):
        fused(q[:, :3], k_cache, v_cache, tables, lens, 0.125)


@pytest.mark.parametrize("path", ["fused", "matmul"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("context_len,length", [(1, 1), (37, 12), (300, 45)])
def test_prefill_chunk_on_cached_context_matches_sdpa(context_len, length, window, path):
    """A chunk whose K/V are already in the cache, after context_len cached tokens: causal, GQA 2; the
    fused decode kernel and chunk_attention's grouped matmuls (a new turn on a conversation's history)."""
    from ferry.kernels.cpu_decode import fused_chunk_attention

    attend = fused_chunk_attention if path == "fused" else ref.chunk_attention
    gen = torch.Generator().manual_seed(context_len + length)
    tables, num_blocks = _tables([context_len + length], gen)
    k_cache, v_cache = (_cache(num_blocks, 2, 64, "head_major", gen) for _ in "kv")
    q, total = torch.randn(length, 4, 64, generator=gen), context_len + length
    got = attend(q, k_cache, v_cache, tables[0], context_len, 0.125, window)
    k_seq, v_seq = ref.gather_seq(k_cache, tables[0], total), ref.gather_seq(v_cache, tables[0], total)
    torch.testing.assert_close(
        got, ref.prefill_attention(q, k_seq, v_seq, context_len, 0.125, window), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "deepseek-v3"])
def test_model_with_kernel_matches_reference_path(arch, kv_dtype, tmp_path, monkeypatch):
    """The whole model (GQA, sliding window, MLA), a mixed prefill/decode batch (one chunk on a cached
    context, so the chunk path runs too), FERRY_CPU_KERNELS=1 vs 0 (which also switches the fused norm,
    activation, rotary and K/V write back to plain torch), on an fp32 and a bf16 cache."""
    from ferry.kernels import resolve_attention
    from ferry.model import AttentionMetadata, load_model
    from ferry.model.make_model import make_model

    lm = load_model(make_model(tmp_path, arch, "tiny", seed=2))
    logits = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("FERRY_CPU_KERNELS", switch)
        lm.model.set_attention_backend(resolve_attention("cpu"))  # read once, as an engine does when built
        kv, gen = lm.model.make_kv_cache(16, BS, dtype=kv_dtype), torch.Generator().manual_seed(5)
        tables = [[3, 4, 5], [6], [7, 8, 9]]
        steps = [([30, 9, 20], [0, 0, 0]), ([1, 1, 12], [30, 9, 20]), ([1, 1, 1], [31, 10, 32])]
        logits[switch] = []
        for query_lens, context_lens in steps:
            meta = AttentionMetadata.build(query_lens, context_lens, tables, BS)
            ids = torch.randint(0, 500, (sum(query_lens),), generator=gen)
            pos = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
            logits[switch].append(lm.model(ids, pos, meta, kv))
    for ours, reference in zip(logits["1"], logits["0"]):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_build_failure_falls_back_to_reference_with_one_warning(monkeypatch, caplog):
    from ferry.model import AttentionMetadata
    from ferry.model.dense_attention import torch_decode_attention

    def no_compiler():
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpu_decode, "_loaded", {})
    monkeypatch.setattr(cpu_decode, "_build", no_compiler)
    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache = (_cache(8, 2, 64, "head_major", gen) for _ in "kv")
    meta = AttentionMetadata.build([1, 1], [20, 30], [[0, 1], [2, 3]], BS)
    q = torch.randn(2, 4, 64, generator=gen)
    with caplog.at_level(logging.WARNING, logger="ferry.kernels.cpu_decode"):
        outs = [torch_decode_attention(q, k_cache, v_cache, meta, 0.125) for _ in range(2)]
    warnings = [r.getMessage() for r in caplog.records if r.name == "ferry.kernels.cpu_decode"]
    assert len(warnings) == 1 and "command not found" in warnings[0]
    expected = ref.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, 0.125)
    torch.testing.assert_close(outs[1], expected)
