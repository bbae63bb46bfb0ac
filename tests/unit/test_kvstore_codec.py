"""Block codec: a stored block decodes to the same tensor; anything damaged or foreign is refused."""

import pytest
import torch

from ferry.kvstore import BlockCorrupt, BlockMismatch, block_key, decode_block, encode_block, parse_block_key
from ferry.kvstore.codec import FIXED_HEADER_BYTES
from ferry.kvstore.keys import namespace_pattern

pytestmark = pytest.mark.unit

NS = "llama:float32:kv1:abc123"


def block(dtype=torch.float32, shape=(2, 2, 16, 4, 8)):  # [layers, K/V, tokens, kv_heads, head_dim]
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_is_bit_exact(dtype):
    original = block(dtype)
    decoded = decode_block(encode_block(original, NS), NS, dtype=dtype, shape=tuple(original.shape))
    assert decoded.dtype == dtype and decoded.shape == original.shape
    assert torch.equal(decoded.view(torch.uint8), original.view(torch.uint8))


def test_non_contiguous_block_is_stored_by_value():
    original = block().transpose(0, 1)
    assert torch.equal(decode_block(encode_block(original, NS), NS), original)


@pytest.mark.parametrize("keep", [0, 10, 30, -1])
def test_truncated_block_is_refused(keep):
    data = encode_block(block(), NS)
    with pytest.raises(BlockCorrupt, match="truncated"):
        decode_block(data[:keep], NS)


def test_padded_block_is_refused():
    with pytest.raises(BlockCorrupt, match="truncated or padded"):
        decode_block(encode_block(block(), NS) + b"\0", NS)


@pytest.mark.parametrize("where", ["payload", "shape", "namespace"])
def test_flipped_bit_is_refused(where):
    data = bytearray(encode_block(block(), NS))
    shape_at = FIXED_HEADER_BYTES  # 5 dims of u32, then the namespace
    index = {"payload": len(data) - 100, "shape": shape_at + 4, "namespace": shape_at + 5 * 4 + 3}[where]
    data[index] ^= 0x04
    with pytest.raises(BlockCorrupt):
        decode_block(bytes(data), NS)


def test_wrong_magic_is_refused():
    data = b"XXXX" + encode_block(block(), NS)[4:]
    with pytest.raises(BlockCorrupt, match="magic"):
        decode_block(data, NS)


def test_other_models_block_is_refused():
    data = encode_block(block(), "qwen2:bfloat16:kv1:ffff")
    with pytest.raises(BlockMismatch, match="namespace"):
        decode_block(data, NS)


def test_a_block_under_another_hash_is_refused():
    data = encode_block(block(), NS, block_hash=bytes(range(16)))
    assert torch.equal(decode_block(data, NS, block_hash=bytes(range(16))), block())
    with pytest.raises(BlockMismatch, match="block hash"):
        decode_block(data, NS, block_hash=bytes(16))


def test_wrong_dtype_or_shape_is_refused():
    data = encode_block(block(torch.float16), NS)
    with pytest.raises(BlockMismatch, match="dtype"):
        decode_block(data, NS, dtype=torch.float32)
    with pytest.raises(BlockMismatch, match="shape"):
        decode_block(data, NS, shape=(2, 2, 16, 4, 4))


def test_unstorable_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="dtype"):
        encode_block(torch.zeros(4, dtype=torch.complex64), NS)


def test_block_keys_round_trip_with_colons_in_the_namespace():
    h = bytes(range(16))
    key = block_key(NS, h)
    assert key == f"ferry:kv:{NS}:{h.hex()}"
    assert parse_block_key(key.encode()) == (NS, h)
    assert parse_block_key("ferry:other") is None and parse_block_key("ferry:kv:ns:zz") is None
    assert namespace_pattern("a*b") == "ferry:kv:a\\*b:*"
    with pytest.raises(ValueError, match="16"):
        block_key(NS, b"short")
