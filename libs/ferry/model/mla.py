"""Multi-head latent attention (DeepSeek-V3) over the paged cache.

The cache holds, per token, only the normalised compressed latent c_kv [kv_lora_rank] and the
rotated shared rope key k_pe [rope_dim]. Prefill expands them through kv_b_proj into per-head keys
and values; decode uses the absorbed form instead: q_nope is folded through W_UK into latent space,
attention runs directly against the cached latents (one shared "KV head"), and W_UV maps the result
back, so decode never materialises per-head K/V for the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ferry.kernels import gather_seq, prefill_attention, write_kv
from ferry.model.attention_meta import AttentionMetadata
from ferry.model.config import ModelConfig
from ferry.model.cpu_linear import Linear
from ferry.model.dense_attention import torch_decode_attention
from ferry.model.kv_cache import PagedKVCache
from ferry.model.layers import RMSNorm
from ferry.model.rope import apply_rotary, yarn_mscale


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """Where a step's prefilling sequences sit in the scratch layout of MLA's batched prefill: sequence j
    owns rows j*width..(j+1)*width, `width` = its longest context rounded up to whole blocks. Built
    once per step from host lengths, shared by every layer."""

    token_rows: torch.Tensor
    """[Tp] the prefilling tokens' rows in the step."""
    slots: torch.Tensor
    """[Bp*width] cache slot of each scratch row (padding rows read slot 0, masked by seq_lens)."""
    fresh_rows: torch.Tensor
    """[F] rows of tokens of sequences with no cached context: their latents are taken from this step
    uncached, as the per-sequence path does."""
    fresh_positions: torch.Tensor
    """[F] their scratch rows."""
    tables: torch.Tensor
    """[Bp, width/block_size] the scratch's block table: sequence j's blocks are j*width/bs..."""
    query_start_loc: torch.Tensor
    """[Bp+1] over the prefilling tokens."""
    seq_lens: torch.Tensor
    """[Bp] context + new tokens."""
    max_query_len: int
    block_size: int


def _prefill_plan(meta: AttentionMetadata, kv: PagedKVCache) -> PrefillPlan:
    rows, bs = meta.prefill_rows, meta.block_size
    totals = [meta.context_lens[i] + meta.query_lens[i] for i in rows]
    width = -(-max(totals) // bs) * bs
    starts = [0]
    token_rows: list[int] = []
    fresh_rows: list[int] = []
    fresh_positions: list[int] = []
    for j, i in enumerate(rows):
        first, count, ctx = meta.query_starts[i], meta.query_lens[i], meta.context_lens[i]
        token_rows.extend(range(first, first + count))
        starts.append(starts[-1] + count)
        if ctx == 0:
            fresh_rows.extend(range(first, first + count))
            fresh_positions.extend(range(j * width, j * width + count))
    device = meta.block_tables.device
    lists = [token_rows, fresh_rows, fresh_positions, starts, totals, list(rows)]
    host = torch.tensor([v for values in lists for v in values], dtype=torch.int64)  # one copy to the device
    token_rows_t, fresh_rows_t, fresh_positions_t, starts_t, totals_t, rows_t = host.to(device).split(
        [len(values) for values in lists]
    )
    positions = torch.arange(width, device=device)
    tables = meta.block_tables[rows_t]  # [Bp, M]
    slots = tables[:, positions // bs] * bs + positions % bs  # [Bp, width]
    plan = PrefillPlan(
        token_rows=token_rows_t,
        slots=slots.flatten(),
        fresh_rows=fresh_rows_t,
        fresh_positions=fresh_positions_t,
        tables=torch.arange(len(rows) * width // bs, device=device).view(len(rows), width // bs),
        query_start_loc=starts_t,
        seq_lens=totals_t,
        max_query_len=max(meta.query_lens[i] for i in rows),
        block_size=bs,
    )
    kv.step_cache(meta)["mla_prefill"] = plan
    return plan


def mla_softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling or {}
    if s.get("rope_type") == "yarn" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.num_heads, self.interleaved = layer, cfg.num_heads, cfg.rope_interleave
        self.nope, self.rope, self.v_dim, self.rank = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        self.scale = mla_softmax_scale(cfg)
        q_out = cfg.num_heads * (self.nope + self.rope)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.o_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope, bias=cfg.o_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.rank, cfg.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(cfg.num_heads * self.v_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.backend = "cpu"
        """One of ATTENTION_BACKENDS, set once by CausalLM.set_attention_backend."""

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self._query(x).view(tokens, self.num_heads, self.nope + self.rope)
        q_nope = q[..., : self.nope]  # [T, H, nope]
        q_pe = apply_rotary(q[..., self.nope :], cos, sin, self.interleaved)  # [T, H, rope]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        k_pe = apply_rotary(k_pe.view(tokens, 1, self.rope), cos, sin, self.interleaved)
        entry = torch.cat([self.kv_a_layernorm(latent).view(tokens, 1, self.rank), k_pe], -1)  # [T, 1, C+R]
        cache = kv.layer(self.layer, 0)  # [N, bs, 1, C+R]
        write_kv(cache, meta.slot_mapping, entry, self.backend == "cpu")
        out = q.new_empty(tokens, self.num_heads, self.v_dim)  # [T, H, Dv]
        if meta.num_decodes:
            rows = meta.decode_token_rows
            out[rows] = self._decode(q_nope[rows], q_pe[rows], cache, meta, kv)
        if meta.prefill_rows and self.backend == "triton":
            plan = kv.step_cache(meta).get("mla_prefill") or _prefill_plan(meta, kv)
            out[plan.token_rows] = self._prefill_batch(q_nope, q_pe, entry, cache, plan)
            return self.o_proj(out.view(tokens, -1))
        for i in meta.prefill_rows:  # CPU: one SDPA per sequence, each on its own context
            start, end, ctx = meta.query_starts[i], meta.query_starts[i + 1], meta.context_lens[i]
            # a cache of another dtype (bf16 under fp32) is widened once gathered
            seq = (
                entry[start:end]
                if ctx == 0
                else gather_seq(cache, meta.block_tables[i], ctx + end - start).to(entry.dtype)
            )
            out[start:end] = self._prefill(q_nope[start:end], q_pe[start:end], seq, ctx)
        return self.o_proj(out.view(tokens, -1))

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, seq: torch.Tensor, ctx: int) -> torch.Tensor:
        """Expanded form: seq [S, 1, C+R] -> per-head keys [S, H, nope+R] and values [S, H, Dv]."""
        length = seq.shape[0]
        kv = self.kv_b_proj(seq[:, 0, : self.rank]).view(length, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, seq[:, :, self.rank :].expand(length, self.num_heads, self.rope)], -1)
        return prefill_attention(torch.cat([q_nope, q_pe], -1), k, v, ctx, self.scale)

    def _prefill_batch(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor, plan: PrefillPlan
    ) -> torch.Tensor:
        """Every prefilling sequence in one kernel launch: their contexts' latents gathered into a
        scratch paged layout (one row of blocks per sequence), expanded to per-head K/V there, then
        the varlen prefill kernel. -> [Tp, H, Dv] for plan.token_rows."""
        from ferry.kernels.triton_prefill import varlen_prefill_attention

        latents = cache.flatten(0, 1)[plan.slots, 0].to(entry.dtype)  # [Bp*W, C+R]
        latents[plan.fresh_positions] = entry[plan.fresh_rows, 0]  # uncached new tokens, as the CPU path
        kv = self.kv_b_proj(latents[:, : self.rank]).view(-1, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = latents[:, None, self.rank :].expand(-1, self.num_heads, self.rope)
        block = plan.block_size
        k = torch.cat([k_nope, k_pe], -1).view(-1, block, self.num_heads, self.nope + self.rope)
        v = v.contiguous().view(-1, block, self.num_heads, self.v_dim)
        q = torch.cat([q_nope, q_pe], -1)[plan.token_rows]  # [Tp, H, nope+R]
        return varlen_prefill_attention(
            q, k, v, plan.tables, plan.query_start_loc, plan.seq_lens, plan.max_query_len, self.scale
        )

    def _decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache
    ) -> torch.Tensor:
        """Absorbed form: q_nope [B, H, nope], q_pe [B, H, R] -> [B, H, Dv]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [H, nope, C], [H, Dv, C]
        q_latent = torch.cat([torch.einsum("bhn,hnc->bhc", q_nope, w_uk), q_pe], -1)  # [B, H, C+R]
        if self.backend == "triton":
            from ferry.kernels.triton_decode import mla_decode_attention

            out_latent = mla_decode_attention(
                q_latent, cache, self.rank, meta.decode_block_tables, meta.decode_seq_lens, self.scale
            )
        else:
            fused = self.backend == "cpu"
            out_latent = torch_decode_attention(
                q_latent, cache, cache[..., : self.rank], meta, self.scale, None, kv, fused
            )
        return torch.einsum("bhc,hvc->bhv", out_latent, w_uv)  # [B, H, Dv]

    @staticmethod
    def make_kv_cache(
        cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> PagedKVCache:
        return PagedKVCache(
            cfg.num_layers, 1, num_blocks, block_size, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, device, dtype
        )
