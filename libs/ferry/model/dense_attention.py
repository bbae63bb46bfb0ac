"""Grouped-query attention over the paged cache (Llama, Mistral, Qwen2)."""

from __future__ import annotations

import torch
from torch import nn

from ferry.kernels import (
    CHUNK_MATMUL_MAX_TOKENS,
    CHUNK_MAX_TOKENS,
    chunk_attention,
    cpu_prefill,
    decode_plan,
    fused_chunk_attention,
    fused_paged_decode_attention,
    gather_seq,
    kernel_built,
    paged_decode_attention,
    prefill_attention,
    rotary_,
    write_kv,
)
from ferry.kernels import quant_linear as qkernels
from ferry.model.attention_meta import AttentionMetadata
from ferry.model.config import ModelConfig
from ferry.model.cpu_linear import FusedProjection, Linear
from ferry.model.kv_cache import PagedKVCache
from ferry.model.layers import fuse_linears
from ferry.model.rope import apply_rotary


def decode_plan_for(meta: AttentionMetadata, block_size: int, window: int | None, dtype: torch.dtype, kv=None):
    """The decoding rows' gather plan, from the host lengths; built by the first layer of the step and
    kept in kv's step cache for the rest (when kv is given)."""
    if not meta.num_decodes:
        return None
    tables, seq_lens, host_lens = meta.decode_block_tables, meta.decode_seq_lens, meta.decode_seq_lens_host
    if kv is None:
        return decode_plan(tables, seq_lens, block_size, window, dtype, host_lens)
    cache, key = kv.step_cache(meta), ("decode_plan", window, dtype)
    if key not in cache:
        cache[key] = decode_plan(tables, seq_lens, block_size, window, dtype, host_lens)
    return cache[key]


def torch_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    kv: PagedKVCache | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """Decode attention of the decoding rows, q [Bd, H, D] -> [Bd, H, Dv]. fused (the 'cpu' backend):
    the C++ kernel, which reads the cache in place, when it is built and switched on; else the plain-torch
    reference, which gathers into kv's scratch buffers when kv is given."""
    tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens
    if fused and kernel_built():
        return fused_paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, window)
    plan = decode_plan_for(meta, k_cache.shape[1], window, q.dtype, kv)
    scratch = None
    if kv is not None and plan:
        most_blocks = max(b.flat_blocks.numel() for b in plan)
        scratch = kv.decode_scratch(most_blocks * kv.block_size * k_cache.shape[2] * k_cache.shape[3])
    return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, window, plan, scratch)


class GQAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.window = layer, cfg.window(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv: FusedProjection | None = None
        self.backend = "cpu"
        """One of ATTENTION_BACKENDS, set once by CausalLM.set_attention_backend."""

    def fuse(self) -> None:
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def prepack(self) -> None:
        if self.qkv is not None:
            self.qkv.prepack()

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q [T, H, D], k [T, Hkv, D] (both rotated), v [T, Hkv, D]."""
        tokens, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            qk = torch.cat([q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)], dim=1)
            q, k = apply_rotary(qk, cos, sin, False).split([heads, kv_heads], dim=1)
            return q, k, v.view(tokens, kv_heads, dim)
        # one matmul; queries and keys sit side by side in its output, so one in-place call rotates both
        qkv = self.qkv(x).view(tokens, heads + 2 * kv_heads, dim)
        rotary_(qkv[:, : heads + kv_heads], cos, sin, self.backend == "cpu")
        return qkv.split([heads, kv_heads, kv_heads], dim=1)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self._project(x, cos, sin)
        write_kv(kv.layer(self.layer, 0), meta.slot_mapping, k, self.backend == "cpu")
        write_kv(kv.layer(self.layer, 1), meta.slot_mapping, v, self.backend == "cpu")
        attend = self._triton_attention if self.backend == "triton" else self._torch_attention
        return self.o_proj(attend(q, k, v, kv, meta).reshape(tokens, -1))

    def _torch_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """'cpu' / 'torch': decoding rows in one batched call, prefilling sequences one by one -> [T, H, D]."""
        k_cache, v_cache = kv.layer(self.layer, 0), kv.layer(self.layer, 1)
        fused = self.backend == "cpu"
        if not meta.prefill_rows:  # a pure decode step: rows are already in sequence order
            return torch_decode_attention(q, k_cache, v_cache, meta, self.scale, self.window, kv, fused)
        bf16 = self._bf16_prompts(q)
        out = torch.empty_like(q, dtype=torch.bfloat16 if bf16 else q.dtype)  # [T, H, D]
        if meta.num_decodes:
            rows = meta.decode_token_rows
            decoded = torch_decode_attention(q[rows], k_cache, v_cache, meta, self.scale, self.window, kv, fused)
            out[rows] = decoded.to(out.dtype)  # index_put_ does not convert
        whole_prompts = bf16 and any(meta.context_lens[i] == 0 for i in meta.prefill_rows)  # else nothing to cast
        whole = (q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)) if whole_prompts else (q, k, v)
        for i in meta.prefill_rows:
            start, end, ctx = meta.query_starts[i], meta.query_starts[i + 1], meta.context_lens[i]
            qs, ks, vs = whole if ctx == 0 else (q, k, v)  # a whole prompt: its K/V are this step's, in bf16 too
            out[start:end] = self._prefill_one(
                qs[start:end], ks[start:end], vs[start:end], k_cache, v_cache, meta.block_tables[i], ctx
            )
        return out

    def _bf16_prompts(self, q: torch.Tensor) -> bool:
        """Whether this step's whole prompts attend in bf16 (torch's flash attention on AMX, 2-2.8x its fp32 at
        64-1000 tokens, 9 heads, 1 thread) and hand o_proj bf16 rows: o_proj multiplies q's rows through its
        bf16 copy, which rounds them to bf16 anyway (quant_linear.BF16_ACTIVATIONS)."""
        copy_takes = getattr(self.o_proj, "copy_takes", None)  # a QuantLinear
        return (
            qkernels.BF16_ACTIVATIONS
            and self.backend == "cpu"
            and q.dtype == torch.float32
            and copy_takes is not None
            and copy_takes(q.shape[0], q.dtype, q.device.type)
        )

    def _prefill_one(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: torch.Tensor,
        ctx: int,
    ) -> torch.Tensor:
        """One prefilling sequence: q [L, H, D], k/v [L, Hkv, D] of its new tokens -> [L, H, D]."""
        if ctx == 0:  # the whole sequence is new: use this step's K/V directly
            if self.backend == "cpu" and cpu_prefill.prefill_usable(q, k, v, self.window):
                return cpu_prefill.prefill_attention(q, k, v, self.scale)
            return prefill_attention(q, k, v, 0, self.scale, self.window)
        fused = self.backend == "cpu" and q.shape[0] <= CHUNK_MAX_TOKENS and kernel_built()
        if fused:  # reads the cached context in place
            return fused_chunk_attention(q, k_cache, v_cache, blocks, ctx, self.scale, self.window)
        if q.shape[0] <= CHUNK_MATMUL_MAX_TOKENS:  # a new turn's few tokens on a long history
            return chunk_attention(q, k_cache, v_cache, blocks, ctx, self.scale, self.window)
        total = ctx + q.shape[0]
        return prefill_attention(
            q, gather_seq(k_cache, blocks, total), gather_seq(v_cache, blocks, total), ctx, self.scale, self.window
        )

    def _triton_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """'triton': one kernel launch for the whole batch, no per-sequence loop."""
        k_cache, v_cache = kv.layer(self.layer, 0), kv.layer(self.layer, 1)
        if not meta.prefill_rows:
            from ferry.kernels.triton_decode import gqa_decode_attention

            return gqa_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, self.window)
        from ferry.kernels.triton_prefill import varlen_prefill_attention

        return varlen_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.max_query_len,
            self.scale,
            self.window,
        )

    @staticmethod
    def make_kv_cache(
        cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> PagedKVCache:
        return PagedKVCache(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, device, dtype)
