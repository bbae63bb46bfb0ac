"""Our AMX bf16 GEMM (csrc/bf16_amx.h) for the bf16 weight copies: against a float64 reference of the same bf16
inputs (the only difference allowed is fp32 summation order, and the output's bf16 rounding where asked), against
oneDNN's GEMM of the same copy, and QuantLinear's copies packed for it (FERRY_QUANT_BF16_AMX). Skipped only on CPUs
without amx_bf16."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import cpu_decode
from ferry.kernels import quant_linear as kernels
from ferry.kernels.quant_linear import bf16_amx_usable, bf16_copy_matmul, cpu_has_amx_bf16, pack_bf16_amx
from ferry.kernels.quant_ref import dequantize, quantize
from ferry.model import cpu_linear

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def amx():
    assert cpu_decode.kernel() is not None, "the CPU kernels did not build (see the logged warning)"
    if not cpu_has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16 (no amx_bf16 in /proc/cpuinfo): the copies stay oneDNN's")
    assert bf16_amx_usable(), "amx_bf16 in /proc/cpuinfo, but the kernel cannot use the tiles"


def calls() -> int:
    return int(torch.ops.ferry_cpu.bf16_amx_calls())


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float64 from the bf16-rounded inputs (exact products, no fp32 rounding)."""
    return x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().t()


def fp32_sum_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What fp32 summation (any order) may be off by, per output: K * 2^-24 * sum |x_k w_k|, with room."""
    mags = x.to(torch.bfloat16).double().abs() @ w.to(torch.bfloat16).double().abs().t()
    return 2 * x.shape[1] * 2.0**-24 * mags + 1e-30


SHAPES = [(960, 576), (77, 45), (100, 1536), (33, 31), (32, 32), (5, 200)]  # [N, K]; K, N off the tiles' 32 too


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 8, 16, 17, 31, 32, 33, 48, 64, 100, 300, 700])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_sums_the_bf16_products_in_fp32(amx, n, k, rows, x_dtype):
    gen = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = (torch.randn(rows, k, generator=gen) * 2).to(x_dtype)
    x[0, : min(k, 40)] = 0
    packed = pack_bf16_amx(w.to(torch.bfloat16))
    before = calls()
    out = bf16_copy_matmul(x, packed, torch.float32, n)
    assert calls() == before + 1  # the tiles ran
    assert out.shape == (rows, n) and out.dtype == torch.float32
    want = reference(x.float(), w)
    assert ((out.double() - want).abs() <= fp32_sum_bound(x.float(), w)).all()
    rounded = bf16_copy_matmul(x, packed, torch.bfloat16, n)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, out.to(torch.bfloat16))  # the fp32 output rounded to bf16 (nearest even)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 16, 24, 65, 300])
def test_the_kernel_matches_onednns_gemm_of_the_same_copy(amx, n, k, rows):
    gen = torch.Generator().manual_seed(3 * n + k + rows)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen)
    onednn = cpu_linear.pack(w)
    assert onednn is not None and onednn.dim() == 2  # torch's CPU build has oneDNN
    ours = bf16_copy_matmul(x, pack_bf16_amx(w), torch.bfloat16, n)
    theirs = bf16_copy_matmul(x, onednn, torch.bfloat16)
    # both round the same fp32 sum (up to order) to bf16: equal, or one bf16 step apart where it sat on an edge
    diff = (ours.float() - theirs.float()).abs()
    step = theirs.float().abs() * 2.0**-7 + 1e-6
    assert (diff <= step).all()
    assert (diff == 0).float().mean() > 0.9


def test_a_wrong_packed_shape_is_refused(amx):
    packed = pack_bf16_amx(torch.randn(64, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        torch.ops.ferry_cpu.bf16_amx_linear(torch.randn(3, 96), packed, 64)


def test_quantlinear_packs_its_copy_for_the_kernel_and_the_setting_switches_back_to_onednn(amx, monkeypatch):
    from ferry.model.quant_linear import QuantLinear

    gen = torch.Generator().manual_seed(21)
    qw = quantize(torch.randn(80, 96, generator=gen), 4, 32)
    x = torch.randn(40, 96, generator=gen)
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 24)
    layers = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "BF16_AMX", on)
        layer = QuantLinear(qw, None)
        layer.backend = "cpu"
        layer.prepack()
        layers[on] = layer
    assert layers[True].bf16_copy is not None and layers[True].bf16_copy.dim() == 6  # ours, held once
    assert layers[False].bf16_copy is not None and layers[False].bf16_copy.dim() == 2  # oneDNN's
    before = calls()
    ours, theirs = layers[True](x), layers[False](x)
    assert calls() == before + 1
    want = reference(x, dequantize(qw)).float()
    assert ((ours - want).abs() <= fp32_sum_bound(x, dequantize(qw)).float() + 1e-5).all()
    torch.testing.assert_close(theirs, want, atol=0.05, rtol=2**-7)  # oneDNN rounds its output to bf16
    bf16_out = layers[True].bf16_forward(x)
    assert bf16_out is not None and torch.equal(bf16_out, ours.to(torch.bfloat16))
    assert layers[True].bf16_forward(x[:23]) is None  # under BF16_COPY_FROM_ROWS: the int kernel


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_a_bad_bf16_amx_setting_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("FERRY_QUANT_BF16_AMX", value)
    with pytest.raises(ValueError, match="FERRY_QUANT_BF16_AMX"):
        kernels._bf16_amx()
    monkeypatch.setenv("FERRY_QUANT_BF16_AMX", "0")
    assert kernels._bf16_amx() is False
