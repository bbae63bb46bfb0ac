"""Our AVX512_BF16 GEMM (csrc/bf16_dot.h) for the bf16 weight copies on CPUs without AMX: bit for bit against torch
summing the same bf16 products in fp32 in the same order (vdpbf16ps: per input pair the odd input's product, then the
even one's, each add rounded to fp32), its bf16 output the fp32 one rounded, and QuantLinear's copies packed for it
(FERRY_QUANT_BF16_DOT_GEMM). Skipped only on CPUs without avx512_bf16."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import cpu_decode
from ferry.kernels import quant_linear as kernels
from ferry.kernels.quant_linear import bf16_dot_usable, cpu_has_avx512_bf16, pack_bf16_amx
from ferry.kernels.quant_ref import dequantize, quantize

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def dot():
    assert cpu_decode.kernel() is not None, "the CPU kernels did not build (see the logged warning)"
    if not cpu_has_avx512_bf16():
        pytest.skip("this CPU has no AVX512_BF16 (no avx512_bf16 in /proc/cpuinfo)")
    assert bf16_dot_usable(), "avx512_bf16 in /proc/cpuinfo, but the kernel was built without it"


def calls() -> int:
    return int(torch.ops.ferry_cpu.bf16_dot_calls())


def dot_linear(x: torch.Tensor, w: torch.Tensor, out_bf16: bool = False, prefetch: int = -1) -> torch.Tensor:
    return torch.ops.ferry_cpu.bf16_dot_linear(x, pack_bf16_amx(w.to(torch.bfloat16)), w.shape[0], out_bf16, prefetch)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T from the bf16-rounded inputs as vdpbf16ps sums it: one fp32 chain per output over the input pairs in
    order, the odd input's (exact) product added first, each add rounded to fp32."""
    xb, wb = x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()
    if xb.shape[1] % 2:  # the packed weight's zero padding
        xb, wb = torch.nn.functional.pad(xb, (0, 1)), torch.nn.functional.pad(wb, (0, 1))
    acc = torch.zeros(xb.shape[0], wb.shape[0])
    for p in range(xb.shape[1] // 2):
        acc = acc + xb[:, 2 * p + 1, None] * wb[None, :, 2 * p + 1]
        acc = acc + xb[:, 2 * p, None] * wb[None, :, 2 * p]
    return acc


SHAPES = [(960, 576), (77, 45), (100, 1536), (33, 31), (5, 200)]  # [N, K]; K, N off the layout's 32 too


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 16, 24, 33, 64, 100, 600])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_sums_the_bf16_products_as_torch_does_in_that_order(dot, n, k, rows, x_dtype):
    gen = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = (torch.randn(rows, k, generator=gen) * 2).to(x_dtype)
    x[0, : min(k, 40)] = 0
    before = calls()
    out = dot_linear(x, w)
    assert calls() == before + 1  # our kernel ran
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert torch.equal(out, reference(x.float(), w))
    rounded = dot_linear(x, w, out_bf16=True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.to(torch.bfloat16))


@pytest.mark.parametrize("prefetch", [0, 4096, -1])
def test_prefetching_changes_no_number(dot, prefetch):
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(640, 576, generator=gen), torch.randn(40, 576, generator=gen)
    assert torch.equal(dot_linear(x, w, prefetch=prefetch), reference(x, w))


def test_a_wrong_packed_shape_is_refused(dot):
    packed = pack_bf16_amx(torch.randn(64, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        torch.ops.ferry_cpu.bf16_dot_linear(torch.randn(3, 96), packed, 64)


def test_quantlinear_packs_its_copy_for_the_kernel_and_the_setting_switches_back_to_onednn(dot, monkeypatch):
    from ferry.model.quant_linear import QuantLinear

    if kernels.bf16_amx_usable():
        pytest.skip("with AMX the copies go to the AMX kernel (test_bf16_amx.py)")
    gen = torch.Generator().manual_seed(21)
    qw = quantize(torch.randn(80, 96, generator=gen), 4, 32)
    x = torch.randn(40, 96, generator=gen)
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 24)
    layers = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "BF16_DOT_GEMM", on)
        layer = QuantLinear(qw, None)
        layer.backend = "cpu"
        layer.prepack()
        layers[on] = layer
    assert layers[True].bf16_copy is not None and layers[True].bf16_copy.dim() == 6  # ours
    assert layers[False].bf16_copy is not None and layers[False].bf16_copy.dim() == 2  # oneDNN's
    before = calls()
    ours, theirs = layers[True](x), layers[False](x)
    assert calls() == before + 1
    assert torch.equal(ours, reference(x, dequantize(qw)))
    torch.testing.assert_close(theirs, ours, atol=0.05, rtol=2**-7)  # oneDNN rounds its output to bf16
    bf16_out = layers[True].bf16_forward(x)
    assert bf16_out is not None and torch.equal(bf16_out, ours.to(torch.bfloat16))
    assert layers[True].bf16_forward(x[:23]) is None  # under BF16_COPY_FROM_ROWS: the int kernel


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_a_bad_bf16_dot_gemm_setting_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("FERRY_QUANT_BF16_DOT_GEMM", value)
    with pytest.raises(ValueError, match="FERRY_QUANT_BF16_DOT_GEMM"):
        kernels._bf16_dot_gemm()
    monkeypatch.setenv("FERRY_QUANT_BF16_DOT_GEMM", "0")
    assert kernels._bf16_dot_gemm() is False
