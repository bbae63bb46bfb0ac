"""The Triton quantized matmul (ferry.kernels.triton_quant) vs the plain-torch reference, under
TRITON_INTERPRET=1 on CPU (small shapes), and natively when CUDA is present (marked gpu)."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # must be set before the kernel is defined: it then runs on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"

from ferry.kernels.quant_linear import quant_matmul  # noqa: E402
from ferry.kernels.quant_ref import dequantize, quant_matmul_ref, quantize  # noqa: E402
from ferry.kernels.triton_quant import triton_quant_matmul  # noqa: E402

pytestmark = pytest.mark.unit
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="compiled for CUDA here; cuda runs")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]


def _to(qw, device):
    qw.qweight, qw.scales = qw.qweight.to(device), qw.scales.to(device)
    qw.offsets = None if qw.offsets is None else qw.offsets.to(device)
    return qw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits, group_size, rows", [(8, 32, 3), (8, 64, 17), (4, 32, 5), (4, 64, 16)])
def test_triton_matches_the_reference(device, bits, group_size, rows):
    gen = torch.Generator().manual_seed(bits + group_size + rows)
    qw = _to(quantize(torch.randn(40, 128, generator=gen), bits, group_size), device)  # 40: a partial N tile
    x = torch.randn(rows, 128, generator=gen).to(device)
    tol = dict(atol=2e-2, rtol=2e-3) if device == "cuda" else dict(atol=2e-4, rtol=1e-5)  # tf32 dots on a GPU
    torch.testing.assert_close(triton_quant_matmul(x, qw), quant_matmul_ref(x, qw), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_int4_offsets_and_the_dispatch(device, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    qw = quantize(torch.randn(20, 64, generator=gen), 4, 32)
    qw.offsets = torch.randn(20, 2, generator=gen)
    qw = _to(qw, device)
    x = torch.randn(2, 3, 64, generator=gen).to(device)
    tol = dict(atol=2e-2, rtol=2e-3) if device == "cuda" else dict(atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(quant_matmul(x, qw, backend="triton"), x @ dequantize(qw).T, **tol)


def test_triton_wrapper_rejects_a_bad_shape():
    with pytest.raises(ValueError, match="expected"):
        triton_quant_matmul(torch.zeros(2, 32), quantize(torch.zeros(4, 64), 8, 32))
