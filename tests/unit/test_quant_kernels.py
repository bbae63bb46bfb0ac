"""Group-wise int8/int4 weights (ferry.kernels.quant_ref) and the C++ matmuls with them against the plain-torch
reference: the float kernel that dequantizes them in registers (csrc/quant_linear.cpp) and the int8-activation
kernel (csrc/quant_dot.cpp)."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import cpu_decode
from ferry.kernels.quant_linear import (
    ACTIVATION_DIGITS,
    INT8_ACTIVATIONS,
    cpu_quant_matmul,
    dot_kernel_built,
    dot_quant_matmul,
    pack_cpu,
    quant_matmul,
)
from ferry.kernels.quant_pack import DotPacked, pack_for_cpu, pack_for_dot
from ferry.kernels.quant_ref import QuantizedWeight, dequantize, pack_nibbles, quant_matmul_ref, quantize

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kernel():
    assert cpu_decode.kernel() is not None, "the CPU kernels did not build (see the logged warning)"


# int4: half a step (absmax / 16), except values of the other sign beyond 7.5 steps, clamped to 7 (absmax / 8)
@pytest.mark.parametrize("bits, worst", [(8, 0.5 / 127), (4, 1 / 8)])
def test_quantize_error_is_bounded_by_the_group_scale(bits, worst):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 256, generator=gen) * torch.linspace(0.01, 3.0, 40)[:, None]
    qw = quantize(w, bits, 64)
    err = (dequantize(qw) - w).abs().reshape(40, 4, 64).amax(-1)  # [N, groups]
    absmax = w.abs().reshape(40, 4, 64).amax(-1)
    assert (err <= absmax * worst * 1.0001 + 1e-7).all()
    assert qw.nbytes() < w.numel() * (2 if bits == 4 else 1.2)


def test_int4_codes_use_the_full_range_and_a_constant_group_is_exact():
    w = torch.tensor([[-4.0, 1.0] * 16, [3.0] * 32])  # row 0: extreme -4 -> code 0; row 1: constant
    qw = quantize(w, 4, 32)
    assert torch.equal(dequantize(qw), w)
    assert qw.qweight.shape == (2, 16) and qw.qweight.dtype == torch.uint8


def test_int4_offsets_give_an_asymmetric_group_exactly():
    """A GGUF Q4_1 group (w = u * d + m) keeps its offsets."""
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 1, 32)
    scales, offsets = torch.tensor([[0.5]]), torch.tensor([[10.0]])
    qw = QuantizedWeight(pack_nibbles(codes, 1, 32), scales, offsets, 4, 32)
    assert torch.equal(dequantize(qw), (codes.float() * 0.5 + 10.0).reshape(1, 32))


def test_bad_shapes_and_settings_are_refused():
    with pytest.raises(ValueError, match="group_size 64"):
        quantize(torch.zeros(4, 96), 8, 64)
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.zeros(4, 96), 8, 48)
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.zeros(4, 64), 3, 32)
    with pytest.raises(ValueError, match="last dimension"):
        quant_matmul(torch.zeros(2, 32), quantize(torch.zeros(4, 64), 8, 32))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40])  # one pass or tile of each width, and a remainder
@pytest.mark.parametrize("path", ["registers", "tiled"])
def test_cpu_kernel_matches_the_reference(kernel, bits, group_size, rows, path):
    gen = torch.Generator().manual_seed(bits * 1000 + group_size + rows)
    w, x = torch.randn(70, 384, generator=gen), torch.randn(rows, 384, generator=gen)  # 70: a partial block
    qw = quantize(w, bits, group_size)
    tiled_from_rows = 1 if path == "tiled" else rows + 1
    out = cpu_quant_matmul(x, pack_for_cpu(qw), tiled_from_rows)
    torch.testing.assert_close(out, quant_matmul_ref(x, qw), atol=2e-4, rtol=1e-5)


def test_both_cpu_kernel_paths_give_the_same_sums(kernel):
    """The path a batch's size picks must not change its rows' logits (greedy text stays put): for rows that
    fill whole register passes both paths add the same products in the same order."""
    gen = torch.Generator().manual_seed(11)
    packed = pack_for_cpu(quantize(torch.randn(96, 256, generator=gen), 4, 32))
    x = torch.randn(16, 256, generator=gen)
    assert torch.equal(cpu_quant_matmul(x, packed, 1), cpu_quant_matmul(x, packed, 10**9))


def test_cpu_kernel_applies_int4_offsets(kernel):
    gen = torch.Generator().manual_seed(5)
    qw = quantize(torch.randn(33, 128, generator=gen), 4, 32)
    qw.offsets = torch.randn(33, 4, generator=gen)
    x = torch.randn(5, 128, generator=gen)
    torch.testing.assert_close(cpu_quant_matmul(x, pack_for_cpu(qw)), x @ dequantize(qw).T, atol=2e-4, rtol=1e-5)


def test_quant_matmul_keeps_leading_dims_adds_bias_and_falls_back_for_bf16(kernel):
    gen = torch.Generator().manual_seed(6)
    qw, bias = quantize(torch.randn(24, 64, generator=gen), 8, 32), torch.randn(24, generator=gen)
    x = torch.randn(2, 3, 64, generator=gen)
    expected = x @ dequantize(qw).T + bias
    rounded = x  # what the CPU kernel multiplies: x itself, or its int8 digits (the int8-activation kernel)
    if isinstance(pack_cpu(qw), DotPacked):
        rounded = _quantize_activations(x.reshape(6, 64), ACTIVATION_DIGITS[8]).reshape(x.shape)
    torch.testing.assert_close(quant_matmul(x, qw, bias), rounded @ dequantize(qw).T + bias, atol=2e-4, rtol=1e-5)
    got_bf16 = quant_matmul(x.bfloat16(), qw, bias)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.float(), expected, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("value", ["eight", "0", "-3"])
def test_a_bad_tiled_rows_setting_is_refused_by_name(monkeypatch, value):
    from ferry.kernels.quant_linear import _tiled_from_rows

    monkeypatch.setenv("FERRY_QUANT_TILED_FROM_ROWS", value)
    with pytest.raises(ValueError, match="FERRY_QUANT_TILED_FROM_ROWS"):
        _tiled_from_rows()


def _quantize_activations(x: torch.Tensor, digits: int) -> torch.Tensor:
    """The int8-activation kernel's rounding of x [M, K] in torch, with the kernel's fp32 operations (t = x *
    (127 / absmax), the remainder x * inv - q1 rounded once: a last-bit difference there moves the second digit,
    which two digits magnify 256-fold): per 32 inputs, q1 = round(t); two digits add the remainder in steps of
    1/256 (clamped to +-127)."""
    chunks = x.reshape(x.shape[0], -1, 32)
    absmax = chunks.abs().amax(-1, keepdim=True)
    inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    t = (chunks * inv).clamp(-127, 127)
    hi = torch.round(t)
    if digits == 1:
        return (hi * (absmax / 127.0)).reshape(x.shape)
    remainder = (chunks.double() * inv.double() - hi.double()).float()  # the kernel's FMA: one rounding
    lo = torch.round(remainder * 256).clamp(-127, 127)
    return ((hi * 256 + lo) * (absmax / 127.0 / 256.0)).reshape(x.shape)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40])  # within one register pass, several, and a remainder
@pytest.mark.parametrize("digits", [1, 2])
def test_int8_activation_kernel_matches_the_reference(kernel, bits, group_size, rows, digits):
    """Against torch on the same rounded activations (one digit) the sums are exact up to fp32 rounding; against
    the unrounded x, each input is off by at most d / 2 (two digits: d / 512, or d / 256 where the second digit's
    clamp to 127 bites), d = its chunk's absmax / 127, so an output is off by at most sum_k |w_k| times that:
    the bound checked (plus fp32 rounding), not a loose tolerance."""
    if not dot_kernel_built():
        pytest.skip("the int8-activation kernel needs AVX2 (this machine or -march target lacks it)")
    gen = torch.Generator().manual_seed(bits * 1000 + group_size + rows + digits)
    w, x = torch.randn(70, 384, generator=gen), torch.randn(rows, 384, generator=gen) * 3  # 70: a partial block
    qw = quantize(w, bits, group_size)
    if bits == 4 and group_size == 64:  # GGUF Q4_1-style offsets
        qw.offsets = torch.randn(70, 384 // group_size, generator=gen) * 0.1
    out = dot_quant_matmul(x, pack_for_dot(qw), digits)
    wd = dequantize(qw)
    if digits == 1:  # two digits: a last-bit difference in the remainder may move a second digit by one step
        torch.testing.assert_close(out, _quantize_activations(x, digits) @ wd.T, atol=2e-4, rtol=1e-5)
    d = (x.reshape(rows, -1, 32).abs().amax(-1, keepdim=True) / 127).expand(-1, -1, 32).reshape(rows, 384)
    bound = (d / (2 if digits == 1 else 256)) @ wd.abs().T  # [rows, 70]
    exact = x @ wd.T
    assert ((out - exact).abs() <= bound + 2e-4 + 1e-5 * exact.abs()).all()


def test_int8_activation_kernel_handles_zero_rows_and_takes_the_wrappers_path(kernel):
    """A zero chunk (scale 0) gives exact zeros, and quant_matmul on the CPU uses the kernel pack_cpu picks."""
    if not dot_kernel_built():
        pytest.skip("the int8-activation kernel needs AVX2")
    gen = torch.Generator().manual_seed(3)
    qw = quantize(torch.randn(40, 128, generator=gen), 8, 32)
    x = torch.randn(3, 128, generator=gen)
    x[1] = 0
    x[2, :32] = 0
    packed = pack_cpu(qw)
    assert isinstance(packed, DotPacked) == INT8_ACTIVATIONS
    out = quant_matmul(x, qw, None, packed)
    assert torch.equal(out[1], torch.zeros(40))
    torch.testing.assert_close(out, x @ dequantize(qw).T, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("bits", [8, 4])
def test_calls_from_bf16_rows_multiply_in_bf16_and_shorter_ones_keep_the_kernel(kernel, monkeypatch, bits):
    from ferry.kernels import quant_linear as kernels
    from ferry.kernels.quant_linear import bf16_quant_matmul
    from ferry.model.quant_linear import QuantLinear

    gen = torch.Generator().manual_seed(9)
    qw, bias = quantize(torch.randn(48, 128, generator=gen), bits, 32), torch.randn(48, generator=gen)
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 0)  # no bf16 copy: the per-call dequantization
    layer = QuantLinear(qw, bias)
    layer.backend = "cpu"
    layer.prepack()
    short, long = torch.randn(7, 128, generator=gen), torch.randn(40, 128, generator=gen)
    monkeypatch.setattr(kernels, "BF16_FROM_ROWS", 0)
    kernel_short, kernel_long = layer(short), layer(long)  # off: the kernel at every size
    monkeypatch.setattr(kernels, "BF16_FROM_ROWS", 16)
    via_bf16 = bf16_quant_matmul(long, qw) + bias
    assert torch.equal(layer(long), via_bf16) and torch.equal(quant_matmul(long, qw, bias, layer.packed), via_bf16)
    assert not torch.equal(via_bf16, kernel_long)  # the switch happened: bf16 rounding differs from the kernel's
    assert torch.equal(layer(short), kernel_short)  # under the row count: the kernel, bit for bit
    torch.testing.assert_close(via_bf16, long @ dequantize(qw).T + bias, atol=0.15, rtol=0.02)


ROW_SETTINGS = [  # name, reader, default with AMX, default with AVX512_BF16 but no AMX
    ("FERRY_QUANT_BF16_FROM_ROWS", "_bf16_from_rows", 512, 0),
    ("FERRY_QUANT_BF16_COPY_FROM_ROWS", "_bf16_copy_from_rows", 16, 24),  # 24: our AVX512_BF16 GEMM's
]


@pytest.mark.parametrize("name, reader, _, __", ROW_SETTINGS)
@pytest.mark.parametrize("value", ["many", "-1", "1.5"])
def test_a_bad_bf16_rows_setting_is_refused_by_name(monkeypatch, name, reader, _, __, value):
    from ferry.kernels import quant_linear as kernels

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        getattr(kernels, reader)()


@pytest.mark.parametrize("name, reader, with_amx, with_avx512_bf16", ROW_SETTINGS)
@pytest.mark.parametrize("amx, avx512_bf16", [(True, True), (False, True), (False, False)])
def test_bf16_rows_settings_default_by_what_the_cpu_has(
    monkeypatch, name, reader, with_amx, with_avx512_bf16, amx, avx512_bf16
):
    from ferry.kernels import quant_linear as kernels

    monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kernels, "cpu_has_amx_bf16", lambda: amx)
    monkeypatch.setattr(kernels, "cpu_has_avx512_bf16", lambda: avx512_bf16)
    assert getattr(kernels, reader)() == (with_amx if amx else with_avx512_bf16 if avx512_bf16 else 0)
    monkeypatch.setenv(name, "0")
    assert getattr(kernels, reader)() == 0


@pytest.mark.parametrize("bits", [8, 4])
def test_a_bf16_copy_multiplies_calls_from_its_row_count_and_shorter_ones_keep_the_kernel(kernel, monkeypatch, bits):
    from ferry.kernels import quant_linear as kernels
    from ferry.model.quant_linear import QuantLinear

    gen = torch.Generator().manual_seed(11)
    qw, bias = quantize(torch.randn(48, 128, generator=gen), bits, 32), torch.randn(48, generator=gen)
    short, long = torch.randn(7, 128, generator=gen), torch.randn(3, 8, 128, generator=gen)  # 7 and 24 rows
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 0)
    plain = QuantLinear(qw, bias)
    plain.backend = "cpu"
    plain.prepack()
    assert plain.bf16_copy is None  # off: no copy, no memory spent
    kernel_short, kernel_long = plain(short), plain(long)
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 24)
    layer = QuantLinear(qw, bias)
    layer.backend = "cpu"
    layer.prepack()
    assert layer.bf16_copy is not None and layer.bf16_copy.dtype == torch.bfloat16
    assert torch.equal(layer(short), kernel_short)  # under the row count: the kernel, bit for bit
    got = layer(long)
    assert got.shape == (3, 8, 48) and got.dtype == torch.float32
    reference = torch.mm(long.reshape(24, 128).bfloat16(), dequantize(qw, torch.bfloat16).t()).float() + bias
    torch.testing.assert_close(got.reshape(24, 48), reference, atol=0.1, rtol=2**-6)  # an ulp of bf16 output apart
    assert not torch.equal(got, kernel_long)  # the switch happened: bf16 rounding differs from the kernel's
    torch.testing.assert_close(got, long @ dequantize(qw).T + bias, atol=0.15, rtol=0.02)
    layer.backend = "torch"  # another backend never reads the copy
    torch.testing.assert_close(layer(long), long @ dequantize(qw).T + bias, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 0)  # switched off after load: the kernel again
    layer.backend = "cpu"
    assert torch.equal(layer(long), kernel_long)


def test_bf16_copies_stay_within_their_memory_cap_and_a_freed_layer_gives_its_bytes_back(kernel, monkeypatch):
    import gc

    from ferry.kernels import quant_linear as kernels
    from ferry.model.quant_linear import QuantLinear

    qw = quantize(torch.randn(48, 128, generator=torch.Generator().manual_seed(12)), 4, 32)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(13))
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 24)
    gc.collect()  # copies of earlier tests' layers that are garbage already, so the gc.collect() below frees only ours
    held = kernels.bf16_copy_bytes()
    monkeypatch.setattr(kernels, "BF16_COPY_MAX_BYTES", held + 48 * 128 * 2)  # room for one layer's copy
    layers = [QuantLinear(qw, None) for _ in range(2)]
    for layer in layers:
        layer.backend = "cpu"
        layer.prepack()
    assert layers[0].bf16_copy is not None and layers[1].bf16_copy is None  # the second would pass the cap
    assert kernels.bf16_copy_bytes() == held + 48 * 128 * 2
    torch.testing.assert_close(layers[1](x), x @ dequantize(qw).T, atol=0.15, rtol=0.02)  # the kernel serves it
    del layers[0]
    gc.collect()
    assert kernels.bf16_copy_bytes() == held
    again = QuantLinear(qw, None)
    again.backend = "cpu"
    again.prepack()
    assert again.bf16_copy is not None
