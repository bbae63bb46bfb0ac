"""The int8-activation kernel's AMX int8 tile path (csrc/quant_dot_amx.h) against its VNNI loop: the same
activation digits and exact int32 sums per 32 inputs, the same fp32 epilogue in the same order, so the same
output bit for bit; and its setting, FERRY_QUANT_AMX_INT8. Skipped only on CPUs without amx_int8."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import cpu_decode
from ferry.kernels import quant_linear as kernels
from ferry.kernels.quant_linear import amx_int8_usable, cpu_has_amx_int8, dot_kernel_built, dot_quant_matmul
from ferry.kernels.quant_pack import pack_for_dot
from ferry.kernels.quant_ref import quantize

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def amx():
    assert cpu_decode.kernel() is not None, "the CPU kernels did not build (see the logged warning)"
    if not cpu_has_amx_int8():
        pytest.skip("this CPU has no AMX-INT8 (no amx_int8 in /proc/cpuinfo): only the VNNI loop exists here")
    assert dot_kernel_built() and amx_int8_usable(), "amx_int8 in /proc/cpuinfo, but the kernel cannot use the tiles"


def amx_calls() -> int:
    return int(torch.ops.ferry_cpu.quant_dot_amx_calls())


def weight(bits: int, group_size: int, n: int, k: int, gen: torch.Generator, offsets: bool):
    qw = quantize(torch.randn(n, k, generator=gen), bits, group_size)
    if offsets:  # GGUF Q4_1-style mins
        qw.offsets = torch.randn(n, k // group_size, generator=gen) * 0.1
    return qw


@pytest.mark.parametrize("bits, group_size, offsets", [(8, 32, False), (4, 32, True), (4, 32, False), (4, 128, False)])
@pytest.mark.parametrize("rows", [1, 7, 9, 16, 23, 31, 64])
@pytest.mark.parametrize("digits", [1, 2])
def test_the_tiles_give_the_vnni_kernels_output_bit_for_bit(amx, bits, group_size, offsets, rows, digits):
    """Odd shapes: K = 13 chunks of 32 (4 groups of 128 do not fit it, so that case takes K = 384), N = 77 (the
    last 16-column block partial); rows across one tile pass, two and four; zero chunks (activation scale 0)."""
    gen = torch.Generator().manual_seed(bits * 100 + group_size + rows + digits)
    k = 416 if group_size == 32 else 384
    packed = pack_for_dot(weight(bits, group_size, 77, k, gen, offsets))
    x = torch.randn(rows, k, generator=gen) * 3
    x[0, 32:64] = 0
    before = amx_calls()
    tiles = dot_quant_matmul(x, packed, digits, amx_from_rows=1)
    assert amx_calls() == before + 1  # the tile path ran
    vnni = dot_quant_matmul(x, packed, digits, amx_from_rows=0)
    assert amx_calls() == before + 1  # off: the VNNI loop
    assert torch.equal(tiles, vnni)


def test_calls_under_the_row_count_keep_the_vnni_loop(amx):
    gen = torch.Generator().manual_seed(5)
    packed = pack_for_dot(weight(4, 32, 40, 128, gen, True))
    before = amx_calls()
    dot_quant_matmul(torch.randn(7, 128, generator=gen), packed, amx_from_rows=8)
    assert amx_calls() == before
    dot_quant_matmul(torch.randn(8, 128, generator=gen), packed, amx_from_rows=8)
    assert amx_calls() == before + 1


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quant_linear_takes_the_tiles_for_2d_and_3d_input_with_the_same_output(amx, monkeypatch, bits):
    """QuantLinear's decode path (2-D rows) binds the setting at prepack: a layer packed with it on uses the tiles,
    one packed with it off never does; 3-D input goes through quant_matmul, which reads it per call. The same
    numbers every way."""
    from ferry.model.quant_linear import QuantLinear

    gen = torch.Generator().manual_seed(bits)
    qw, bias = weight(bits, 32, 50, 192, gen, bits == 4), torch.randn(50, generator=gen)
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 0)  # no bf16 copy: every call reaches the kernel
    layers = {}
    for setting in (0, 8):
        monkeypatch.setattr(kernels, "AMX_INT8_FROM_ROWS", setting)
        layers[setting] = QuantLinear(qw, bias)
        layers[setting].backend = "cpu"
        layers[setting].prepack()
    rows, batch = torch.randn(12, 192, generator=gen), torch.randn(2, 9, 192, generator=gen)
    before = amx_calls()
    off = layers[0](rows)
    assert amx_calls() == before
    on = layers[8](rows)
    assert amx_calls() == before + 1 and torch.equal(on, off)
    outs = {}
    for setting in (0, 8):
        monkeypatch.setattr(kernels, "AMX_INT8_FROM_ROWS", setting)
        before = amx_calls()
        outs[setting] = layers[0](batch)
        assert amx_calls() == before + (setting > 0) and outs[setting].shape == (2, 9, 50)
    assert torch.equal(outs[8], outs[0])


@pytest.mark.parametrize("value", ["on", "-1", "1.5", "yes"])
def test_a_bad_amx_int8_setting_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("FERRY_QUANT_AMX_INT8", value)
    with pytest.raises(ValueError, match="FERRY_QUANT_AMX_INT8"):
        kernels._amx_int8_from_rows()


@pytest.mark.parametrize("has_amx_int8", [True, False])
def test_amx_int8_is_on_by_default_only_where_the_cpu_has_it(monkeypatch, has_amx_int8):
    monkeypatch.delenv("FERRY_QUANT_AMX_INT8", raising=False)
    monkeypatch.setattr(kernels, "cpu_has_amx_int8", lambda: has_amx_int8)
    assert kernels._amx_int8_from_rows() == (kernels.AMX_INT8_DEFAULT_ROWS if has_amx_int8 else 0)
    monkeypatch.setenv("FERRY_QUANT_AMX_INT8", "0")
    assert kernels._amx_int8_from_rows() == 0
    monkeypatch.setenv("FERRY_QUANT_AMX_INT8", "12")
    assert kernels._amx_int8_from_rows() == 12


def test_dot_arguments_carry_the_setting(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    packed = pack_for_dot(weight(8, 32, 16, 64, gen, False))
    monkeypatch.setattr(kernels, "AMX_INT8_FROM_ROWS", 0)
    assert kernels.dot_arguments(packed)[-1] == 0
    monkeypatch.setattr(kernels, "AMX_INT8_FROM_ROWS", 8)
    assert kernels.dot_arguments(packed)[-1] == 8 and kernels.dot_arguments(packed, amx_from_rows=0)[-1] == 0
