"""One KV block as bytes: a self-checking header followed by the raw tensor bytes.

Layout (little endian):

    magic     4s   b"FKVB"
    version   u16  FORMAT_VERSION
    dtype     u8   code from _DTYPE_CODES
    ndim      u8
    ns_len    u16  length of the namespace (model fingerprint), utf-8
    payload   u64  number of tensor bytes that follow the header
    hash      16s  the block's chained hash (the key's own), or zeros
    crc       u32  zlib.crc32 over the header (crc field zeroed) + payload
    shape     ndim x u32
    namespace ns_len bytes
    payload   raw bytes of the contiguous tensor

The checksum covers the header too, so a flipped bit in the shape or the namespace is caught, and
a truncated value fails the length check before anything is read. The block names its own hash, so
a value under the wrong key (or a reply matched to the wrong request) is refused, not loaded. Anything wrong raises
`BlockCorrupt`; the store turns that into a miss, so a bad block is never loaded. zlib.crc32 runs at
several GB/s, a small cost next to moving the bytes.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

MAGIC = b"FKVB"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHBBHQ16sI")
_CRC_OFFSET = _FIXED.size - 4
FIXED_HEADER_BYTES = _FIXED.size
"""Bytes before the shape; the namespace follows the shape."""
_NO_HASH = bytes(16)

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.float8_e4m3fn: 7,
    torch.float8_e5m2: 8,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class BlockCorrupt(ValueError):
    """Bytes that are not a complete, intact block of the expected namespace, dtype and shape."""


class BlockMismatch(BlockCorrupt):
    """An intact block, but of another namespace, dtype or shape than the reader asked for."""


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a flat uint8 array (no copy when it is contiguous on CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def encode_header(
    namespace: str, dtype: torch.dtype, shape: tuple[int, ...], payload: memoryview, block_hash: bytes = _NO_HASH
) -> bytes:
    """Header for `payload` (the block's raw bytes), checksum included."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(f"dtype={dtype} is not storable; use one of {sorted(map(str, _DTYPE_CODES))}")
    ns = namespace.encode()
    if len(block_hash) != len(_NO_HASH):
        raise ValueError(f"block_hash has {len(block_hash)} bytes, expected {len(_NO_HASH)}")
    header = bytearray(_FIXED.pack(MAGIC, FORMAT_VERSION, code, len(shape), len(ns), len(payload), block_hash, 0))
    header += struct.pack(f"<{len(shape)}I", *shape) + ns
    crc = zlib.crc32(payload, zlib.crc32(header))
    struct.pack_into("<I", header, _CRC_OFFSET, crc)
    return bytes(header)


def encode_block(block: torch.Tensor, namespace: str, block_hash: bytes = _NO_HASH) -> bytes:
    """One block tensor [*block_shape] -> header + raw bytes."""
    payload = memoryview(tensor_bytes(block))  # type: ignore[arg-type]  # numpy's stubs: no __buffer__ before 3.12
    return encode_header(namespace, block.dtype, tuple(block.shape), payload, block_hash) + payload


def check_block(
    data: bytes | memoryview,
    namespace: str,
    dtype: torch.dtype | None = None,
    shape: tuple[int, ...] | None = None,
    block_hash: bytes | None = None,
) -> tuple[torch.dtype, tuple[int, ...], int]:
    """Validate a stored block; return (dtype, shape, payload offset) or raise BlockCorrupt."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise BlockCorrupt(f"truncated: {len(view)} bytes, shorter than the header")
    magic, version, code, ndim, ns_len, num_payload, got_hash, crc = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise BlockCorrupt(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise BlockCorrupt(f"format version {version}, this reader knows {FORMAT_VERSION}")
    offset = _FIXED.size + 4 * ndim + ns_len
    if len(view) != offset + num_payload:
        raise BlockCorrupt(f"truncated or padded: {len(view)} bytes, header says {offset + num_payload}")
    header = bytearray(view[:offset])
    struct.pack_into("<I", header, _CRC_OFFSET, 0)
    if zlib.crc32(view[offset:], zlib.crc32(header)) != crc:
        raise BlockCorrupt("checksum mismatch")
    got_ns = bytes(view[_FIXED.size + 4 * ndim : offset]).decode(errors="replace")
    if got_ns != namespace:
        raise BlockMismatch(f"namespace {got_ns!r}, expected {namespace!r}")
    if block_hash is not None and got_hash != block_hash:
        raise BlockMismatch(f"block hash {got_hash.hex()}, expected {block_hash.hex()}")
    return _check_layout(view, code, ndim, num_payload, dtype, shape) + (offset,)


def _check_layout(view, code, ndim, num_payload, dtype, shape) -> tuple[torch.dtype, tuple[int, ...]]:
    got_dtype = _CODE_DTYPES.get(code)
    if got_dtype is None:
        raise BlockCorrupt(f"unknown dtype code {code}")
    got_shape = struct.unpack_from(f"<{ndim}I", view, _FIXED.size)
    if dtype is not None and got_dtype != dtype:
        raise BlockMismatch(f"dtype {got_dtype}, expected {dtype}")
    if shape is not None and tuple(got_shape) != tuple(shape):
        raise BlockMismatch(f"shape {tuple(got_shape)}, expected {tuple(shape)}")
    if int(np.prod(got_shape, dtype=np.int64)) * got_dtype.itemsize != num_payload:
        raise BlockCorrupt(f"payload of {num_payload} bytes does not fit shape {got_shape} {got_dtype}")
    return got_dtype, tuple(got_shape)


def decode_block(
    data: bytes | memoryview,
    namespace: str,
    dtype: torch.dtype | None = None,
    shape: tuple[int, ...] | None = None,
    block_hash: bytes | None = None,
) -> torch.Tensor:
    """Stored bytes -> a fresh block tensor [*block_shape]; raises BlockCorrupt on anything wrong."""
    got_dtype, got_shape, offset = check_block(data, namespace, dtype, shape, block_hash)
    out = torch.empty(got_shape, dtype=got_dtype)
    copy_payload(data, offset, out)
    return out


def copy_payload(data: bytes | memoryview, offset: int, out: torch.Tensor) -> None:
    """Copy a checked block's payload into `out` (contiguous CPU tensor of the block's size)."""
    dst = out.reshape(-1).view(torch.uint8).numpy()
    dst[:] = np.frombuffer(data, dtype=np.uint8, count=dst.size, offset=offset)
