"""PagedKVCache: a pool of fixed-size blocks, each holding every layer's keys and values.

Dense attention layout: one tensor [L, 2, N, block_size, H_kv, D], so each layer's K (or V) is a
contiguous [N, block_size, H_kv, D] view that kernels and index ops use directly.
MLA layout (DeepSeek-V3): [L, 1, N, block_size, 1, kv_lora_rank + rope_dim]: the compressed
latent and the rotated rope key, the only per-token state MLA needs.
"""

from __future__ import annotations

import torch

KV_LAYOUT_VERSION = 1


class PagedKVCache:
    def __init__(self, num_layers: int, num_planes: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, device: torch.device | str, dtype: torch.dtype) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: must be positive")
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        # [L, planes, N, bs, H, D]; planes = 2 (K, V) or 1 (MLA latent+rope)
        self.data = torch.zeros(num_layers, num_planes, num_blocks, block_size, num_kv_heads, head_dim,
                                device=device, dtype=dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block as read_blocks returns it: [L, planes, block_size, H, D]."""
        num_layers, planes, _, bs, heads, dim = self.data.shape
        return (num_layers, planes, bs, heads, dim)

    def layer(self, layer: int, plane: int) -> torch.Tensor:
        return self.data[layer, plane]  # [N, bs, H, D], contiguous

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """-> [n, *block_shape], a contiguous CPU copy."""
        index = self._index(block_ids)
        return self.data.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (len(block_ids), *self.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"data: shape {tuple(data.shape)} != expected {expected}")
        index = self._index(block_ids)
        src = data.to(device=self.data.device, dtype=self.dtype).permute(1, 2, 0, 3, 4, 5)
        self.data.index_copy_(2, index, src)

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=self.data.device)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise ValueError(f"block_ids: out of range 0..{self.num_blocks - 1}")
        return index
