"""The fused small ops of a CPU step (ferry.kernels.cpu_layers, C++ in csrc/cpu_layers.cpp) against plain
torch: RMSNorm, SiLU-and-mul, rotary in place, the K/V write and the greedy argmax, on the strided views the
model hands them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferry.kernels import attention_ref, cpu_decode, cpu_layers
from ferry.model.rope import apply_rotary

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_decode.kernel() is not None, "the CPU kernels did not build (see the logged warning)"


def _wide(rows: int, width: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """A [rows, width] view whose rows are strided (the left part of a wider tensor), as a fused matmul's
    output slices are."""
    return (torch.randn(rows, width + 24, generator=gen) * scale)[:, :width]


def test_rms_norm_matches_torch():
    gen = torch.Generator().manual_seed(0)
    x, weight = _wide(33, 512, gen, 3.0), torch.randn(512, generator=gen)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = cpu_layers.rms_norm(x, weight, 1e-6)
    assert got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_add_rms_norm_equals_the_add_then_rms_norm_bit_for_bit(fused):
    gen = torch.Generator().manual_seed(7)
    x, delta, weight = _wide(37, 512, gen, 3.0), _wide(37, 512, gen), torch.randn(512, generator=gen)
    added = x + delta
    expected = cpu_layers.rms_norm(added, weight, 1e-5, fused)
    got = cpu_layers.add_rms_norm_(x, delta, weight, 1e-5, fused)
    assert torch.equal(x, added)  # the residual stream is updated in place
    assert torch.equal(got, expected) and got.is_contiguous()


@pytest.mark.parametrize("scale", [1.0, 60.0])  # 60: exp(-|g|) underflows; nothing may overflow to inf/nan
def test_silu_and_mul_matches_torch(scale):
    gen = torch.Generator().manual_seed(1)
    x = _wide(17, 2 * 1408, gen, scale)
    gate, up = x.chunk(2, dim=-1)
    got = cpu_layers.silu_and_mul(x)
    assert got.shape == (17, 1408) and torch.isfinite(got).all()
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 60.0])
def test_silu_and_mul_of_bf16_rows_is_the_fp32_product_rounded_once(scale):
    """bf16 gate/up rows (a bf16 copy's matmul output on AMX), strided: the C++ op widens, multiplies in fp32 and
    rounds once, so it is within one bf16 rounding of the exact fp32 product (ATen's silu then mul rounds twice)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(19, 2 * 1408 + 32, generator=gen) * scale).bfloat16()[:, : 2 * 1408]
    assert not x.is_contiguous()
    gate, up = x.float().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    got = cpu_layers.silu_and_mul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (19, 1408) and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), exact, atol=1e-30, rtol=2**-8)
    rounded = exact.bfloat16()
    assert (got != rounded).float().mean() < 0.01  # the C++ exp is not libm's: a rare last-bit tie may differ


def test_rotary_in_place_matches_apply_rotary_and_leaves_values_alone():
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim = 9, 8, 4, 64
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6.0
    cos, sin = angles.cos(), angles.sin()
    expected = apply_rotary(qkv[:, : heads + kv_heads].clone(), cos, sin, False)
    values = qkv[:, heads + kv_heads :].clone()
    out = cpu_layers.rotary_(qkv[:, : heads + kv_heads], cos, sin)
    torch.testing.assert_close(qkv[:, : heads + kv_heads], expected, atol=1e-6, rtol=1e-6)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, heads + kv_heads :], values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_equals_torch_including_rounding(dtype):
    """Same bits as index_copy_ after torch's conversion (round-to-nearest-even ties and infinities
    included); a NaN stays a NaN (torch's own paths disagree on its bits: 0x7FC0 scalar, 0xFFFF vectorised)."""
    gen = torch.Generator().manual_seed(3)
    kv_heads, blocks, bs, dim = 4, 10, 16, 64
    cache = torch.zeros(kv_heads, blocks, bs, dim, dtype=dtype).permute(1, 2, 0, 3)  # head-major, as PagedKVCache
    slots = torch.randperm(blocks * bs, generator=gen)[:20]
    values = torch.randn(20, kv_heads + 2, dim, generator=gen)[:, :kv_heads]  # strided rows, like k of a qkv
    # exact bf16 ties (one bit past the kept mantissa set, the kept last bit 0 or 1), and the special values
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F800000, 0xFF800000], dtype=torch.int64)
    values[0, 0, :5] = ties.to(torch.int32).view(torch.float32)
    values[0, 0, 5] = float("nan")
    expected = cache.clone()
    attention_ref.write_kv(expected, slots, values)
    cpu_layers.write_kv(cache, slots, values)
    nan = expected.isnan()
    assert nan.sum() == 1 and torch.equal(cache.isnan(), nan)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(cache.view(bits)[~nan], expected.view(bits)[~nan])


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing():
    cache = torch.zeros(4, 16, 2, 8)
    values = torch.ones(3, 2, 8)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 64 is outside the cache's 64 slots"):
        cpu_layers.write_kv(cache, torch.tensor([0, 5, 64]), values)
    assert not cache.any()


def test_other_dtypes_and_the_switch_take_the_torch_path():
    """bf16 activations are not what the C++ ops take (SiLU-and-mul's aside): the torch fallback answers instead
    of an error; with
    fused=False (a module whose backend is not 'cpu', e.g. FERRY_CPU_KERNELS=0) every op is the fallback
    and gives the same numbers."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    assert not cpu_layers.fused_ops_usable(x.bfloat16())
    got_bf16 = cpu_layers.silu_and_mul(x.bfloat16())
    assert got_bf16.dtype == torch.bfloat16
    fused = cpu_layers.rms_norm(x, weight, 1e-5), cpu_layers.silu_and_mul(x)
    plain = cpu_layers.rms_norm(x, weight, 1e-5, fused=False), cpu_layers.silu_and_mul(x, fused=False)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,width", [(1, 49152), (7, 1000), (25, 49152), (3, 65)])
def test_argmax_rows_equals_torch_argmax_with_ties_nans_and_infinities(rows, width):
    """The same ids as torch.argmax on logits-like rows, strided rows included; ties go to the first index,
    a NaN counts as the largest (the first NaN wins), an all -inf row picks 0, +inf beats everything."""
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = _wide(rows, width, gen, 4.0)
    special = [
        lambda r: r.fill_(-float("inf")),
        lambda r: r.__setitem__(slice(width // 3, None, width // 5 or 1), 50.0),  # a tie, first one wins
        lambda r: r.__setitem__(width - 1, float("inf")),
        lambda r: (r.__setitem__(width // 2, float("nan")), r.__setitem__(width - 1, float("nan"))),
        lambda r: r.__setitem__(0, 99.0),
        lambda r: r.__setitem__(width - 1, 99.0),
    ]
    for i in range(min(rows, len(special))):
        special[i](x[i])
    got = cpu_layers.argmax_rows(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert cpu_layers.argmax_rows(x, fused=False).tolist() == got.tolist()
    if rows > 1:  # each row alone: a row's pick never depends on its neighbours
        assert [int(cpu_layers.argmax_rows(x[i : i + 1])[0]) for i in range(rows)] == got.tolist()
