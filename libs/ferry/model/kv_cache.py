"""PagedKVCache: a pool of fixed-size blocks, each holding every layer's keys and values.

Storage is one tensor [L, planes, H_kv, N, block_size, D]: planes = 2 (K, V) for dense attention,
1 for MLA (DeepSeek-V3), whose single "head" holds the compressed latent and the rotated rope key
(D = kv_lora_rank + rope_dim), the only per-token state MLA needs. Head-major storage lets the CPU
decode path gather a batch's blocks with one index_select into a contiguous [H_kv, B, S, D] tensor
that batched matmuls read without another copy. Layers hand out the logical [N, block_size, H_kv, D]
view (a permutation, no copy); everything downstream uses strides, not the storage order.
"""

from __future__ import annotations

import torch

from ferry.dtypes import raw_view

KV_LAYOUT_VERSION = 1


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_planes: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: must be positive")
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        # [L, planes, H, N, bs, D]
        self.data = torch.zeros(
            num_layers, num_planes, num_kv_heads, num_blocks, block_size, head_dim, device=device, dtype=dtype
        )

        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._step: tuple[object, dict] = (None, {})

    def step_cache(self, meta: object) -> dict:
        """A dict every layer of the step that meta (its AttentionMetadata) describes shares, for what
        they derive alike (decode gather plans); a new meta starts an empty one."""
        if self._step[0] is not meta:
            self._step = (meta, {})
        return self._step[1]

    def decode_scratch(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers of at least numel elements that decode attention gathers K and V into;
        kept across layers and steps, so a decode step allocates no large tensors."""
        if self._scratch is None or self._scratch[0].numel() < numel:
            k, v = (torch.empty(numel, device=self.data.device, dtype=self.dtype) for _ in "kv")
            self._scratch = (k, v)
        return self._scratch

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block as read_blocks returns it: [L, planes, H, block_size, D]."""
        num_layers, planes, heads, _, bs, dim = self.data.shape
        return (num_layers, planes, heads, bs, dim)

    def layer(self, layer: int, plane: int) -> torch.Tensor:
        """[N, bs, H, D] view of plane's [H, N, bs, D] storage; made once per (layer, plane) and kept (every
        layer asks for its K and V views several times a step), remade only if `data` is replaced."""
        views = self._views
        if views is None or views[0] is not self.data:
            planes = self.data.shape[1]
            views = self._views = (
                self.data,
                [self.data[i // planes, i % planes].permute(1, 2, 0, 3) for i in range(self.data.shape[0] * planes)],
            )
        return views[1][layer * self.data.shape[1] + plane]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """-> [n, *block_shape], a contiguous CPU copy."""
        index = self._index(block_ids)
        return self.data.index_select(3, index).permute(3, 0, 1, 2, 4, 5).contiguous().cpu()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (len(block_ids), *self.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"data: shape {tuple(data.shape)} != expected {expected}")
        index = self._index(block_ids)
        src = data.to(device=self.data.device, dtype=self.dtype).permute(1, 2, 3, 0, 4, 5)
        raw_view(self.data).index_copy_(3, index, raw_view(src))  # raw: fp8 has no index_copy_

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=self.data.device)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise ValueError(f"block_ids: out of range 0..{self.num_blocks - 1}")
        return index
