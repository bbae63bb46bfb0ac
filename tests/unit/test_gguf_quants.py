"""Every GGUF tensor type ferry loads, dequantized through GgufFile.tensor, against a reference written
here from the block layouts (ggml's dequantize_row_* as documented): random blocks, element by element."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ferry.model.gguf_reader import TENSOR_TYPES, GgufFile

pytestmark = pytest.mark.unit
Q = gguf.GGMLQuantizationType
ROWS, COLS = 3, 512  # two K-quant super-blocks per row


def _f16(block: np.ndarray, at: int) -> float:
    return float(block[at : at + 2].view(np.float16)[0])


def _q8_0(b):  # d f16, 32 x int8
    return [_f16(b, 0) * q for q in b[2:34].view(np.int8)]


def _q4_0(b):  # d f16, 16 bytes: low nibbles are elements 0..15, high ones 16..31, offset 8
    d, qs = _f16(b, 0), b[2:18].astype(np.int64)
    return [d * ((q & 15) - 8) for q in qs] + [d * ((q >> 4) - 8) for q in qs]


def _q4_1(b):  # d f16, m f16, 16 bytes of nibbles as Q4_0, no offset, plus m
    d, m, qs = _f16(b, 0), _f16(b, 2), b[4:20].astype(np.int64)
    return [d * (q & 15) + m for q in qs] + [d * (q >> 4) + m for q in qs]


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(s[j] & 63), int(s[j + 4] & 63)
    return int((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)), int((s[j + 4] >> 4) | ((s[j] >> 6) << 4))


def _q4_k(b):  # d, dmin f16; 12 bytes of 6-bit scales/mins for 8 sub-blocks; 128 bytes of nibbles
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), b[4:16], b[16:144]
    out = []
    for chunk in range(4):  # 64 elements each: low nibbles of 32 bytes, then their high nibbles
        q = qs[32 * chunk : 32 * chunk + 32]
        for half, shift in ((0, 0), (1, 4)):
            sc, mn = _scale_min_k4(2 * chunk + half, scales)
            out += [d * sc * ((x >> shift) & 15) - dmin * mn for x in q]
    return out


def _q6_k(b):  # ql 128 bytes, qh 64 bytes, 16 int8 scales, d f16
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b, 208)
    out = [0.0] * 256
    for n in range(2):  # 128 elements each
        l_, h_, s_ = ql[64 * n :], qh[32 * n :], sc[8 * n :]
        for i in range(32):
            q = (
                (l_[i] & 15) | (((h_[i] >> 0) & 3) << 4),
                (l_[i + 32] & 15) | (((h_[i] >> 2) & 3) << 4),
                (l_[i] >> 4) | (((h_[i] >> 4) & 3) << 4),
                (l_[i + 32] >> 4) | (((h_[i] >> 6) & 3) << 4),
            )
            for k in range(4):
                out[128 * n + i + 32 * k] = d * s_[i // 16 + 2 * k] * (int(q[k]) - 32)
    return out


REFERENCES = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def _random_blocks(qtype, rng) -> np.ndarray:
    """[ROWS, bytes per row] of random bytes whose f16 scales are small finite numbers."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (ROWS, COLS // block, size), dtype=np.uint8)
    for at in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-0.05, 0.05, (ROWS, COLS // block)).astype(np.float16)
        data[:, :, at : at + 2] = scales.view(np.uint8).reshape(ROWS, COLS // block, 2)
    return data.reshape(ROWS, -1)


def _gguf_with(path, data: np.ndarray, qtype) -> GgufFile:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_down.weight", data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GgufFile(path)


@pytest.mark.parametrize("qtype", list(REFERENCES), ids=lambda t: t.name)
def test_block_types_match_the_reference(qtype, tmp_path):
    data = _random_blocks(qtype, np.random.default_rng(int(qtype)))
    got = _gguf_with(tmp_path / "t.gguf", data, qtype).tensor("model.layers.0.mlp.down_proj.weight")
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    want = [[v for blk in row.reshape(-1, block_bytes) for v in REFERENCES[qtype](blk)] for row in data]
    assert got.shape == (ROWS, COLS) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bf16"], ids=["F32", "F16", "BF16"])
def test_float_types_match_the_reference(dtype, tmp_path):
    values = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    if dtype == "bf16":
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncated: exactly representable
        want = (bits.astype(np.uint32) << 16).view(np.float32)
        w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
        w.add_tensor("blk.0.ffn_down.weight", bits.view(np.uint8), raw_dtype=Q.BF16)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        f = GgufFile(tmp_path / "t.gguf")
    else:
        want = values.astype(dtype).astype(np.float32)
        f = _gguf_with(tmp_path / "t.gguf", values.astype(dtype), None)
    got = f.tensor("model.layers.0.mlp.down_proj.weight", torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert torch.equal(got.float(), torch.from_numpy(want))


def test_the_supported_types_are_the_ones_tested():
    assert set(TENSOR_TYPES) == {*REFERENCES, Q.F32, Q.F16, Q.BF16}
