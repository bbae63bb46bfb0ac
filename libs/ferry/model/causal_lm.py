"""The decoder-only causal LM shared by every architecture; parameter names mirror HF checkpoints
(`model.layers.N.self_attn.q_proj.weight`, ...), so loading is a name-for-name copy."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ferry.kernels import ATTENTION_BACKENDS
from ferry.kernels.cpu_layers import add_rms_norm_
from ferry.model import decode_calls
from ferry.model.attention_meta import AttentionMetadata
from ferry.model.config import ModelConfig
from ferry.model.cpu_linear import FusedProjection, Linear
from ferry.model.dense_attention import GQAttention
from ferry.model.grouped_experts import GroupedExperts
from ferry.model.kv_cache import PagedKVCache
from ferry.model.layers import GatedMLP, RMSNorm
from ferry.model.rope import Rotary

if TYPE_CHECKING:
    from ferry.model.mla import MLAttention


def _attention_class(cfg: ModelConfig) -> type[GQAttention | MLAttention]:
    if cfg.is_mla:
        from ferry.model.mla import MLAttention

        return MLAttention
    return GQAttention


def _mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    if cfg.is_mla and layer >= cfg.first_k_dense_replace:
        from ferry.model.moe import MoE

        return MoE(cfg)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)


def make_rotary(cfg: ModelConfig) -> Rotary:
    dim = cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
    return Rotary(dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _attention_class(cfg)(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _mlp(cfg, layer)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = make_rotary(cfg)
        self.attention_backend = "cpu"
        self._decode_calls: decode_calls.DecodeCalls | bool | None = False
        """decode_calls.decode_calls(self), made at the first pure-decode CPU step (False: not yet)."""

    def tie_weights(self) -> None:
        """Shares the embedding with lm_head when the config says so (again after to_empty, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_attention_backend(self, backend: str) -> None:
        """Every attention layer runs backend (one of ATTENTION_BACKENDS, see ferry.kernels.backend) from
        now on: chosen once, not per call."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend: {backend!r}, expected one of {ATTENTION_BACKENDS}")
        for module in self.modules():  # attention, norms, MLPs, (quantized) linears pick their kernels by it
            if hasattr(module, "backend"):
                module.backend = backend  # type: ignore[assignment]  # a plain str attribute
            for part in vars(module).values():  # fused projections and stacked experts are not modules
                if isinstance(part, (FusedProjection, GroupedExperts)):
                    part.backend = backend
        self.attention_backend = backend
        self._decode_calls = False

    def fuse_projections(self) -> None:
        """After loading: q/k/v and gate/up each become one matmul (parameters become slices)."""
        for module in self.modules():
            fuse = getattr(module, "fuse", None)
            if module is not self and callable(fuse):
                fuse()

    def prepack_cpu_weights(self) -> None:
        """After fuse_projections, on the CPU: every weight matmul gets oneDNN's packed copy (cpu_linear)."""
        for module in self.modules():
            prepack = getattr(module, "prepack", None)
            if module is not self and callable(prepack):
                prepack()
        self._decode_calls = False

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache
    ) -> torch.Tensor:
        """input_ids, positions [T] (every new token, flattened) -> [B, vocab] float32 logits of each
        sequence's last new token. Writes the new tokens' K/V into kv."""
        if input_ids.shape != positions.shape or input_ids.shape[0] != meta.num_tokens:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)}: need [{meta.num_tokens}] each"
            )
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [T, rope_dim/2]
        if self.attention_backend == "cpu" and x.dtype == torch.float32 and x.device.type == "cpu":
            calls = self._decode_calls_for(meta, kv)
            if calls is not None:  # a small pure-decode step: the same ops, called directly
                return self.lm_head(decode_calls.run(calls, x, cos, sin, meta, kv)).float()
            x = self._cpu_layers(x, cos, sin, meta, kv)
        else:
            for layer in self.model.layers:
                x = layer(x, cos, sin, meta, kv)
        last = self.model.norm(x[meta.logits_indices])  # [B, hidden]: only rows we need logits for
        return self.lm_head(last).float()

    def _decode_calls_for(self, meta: AttentionMetadata, kv: PagedKVCache) -> decode_calls.DecodeCalls | None:
        """The bound calls when this step is one decoding token per sequence that they take, else None."""
        if meta.prefill_rows or meta.num_decodes != meta.num_tokens:
            return None
        if self._decode_calls is False:
            self._decode_calls = decode_calls.decode_calls(self)
        calls = self._decode_calls
        assert calls is not True
        return calls if calls is not None and calls.takes(meta.num_tokens, kv) else None

    def _cpu_layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache
    ) -> torch.Tensor:
        """The layers as DecoderLayer.forward runs them, with each residual add and the norm after it in one
        C++ pass (x, the embedding's fresh output, is added to in place): the same values, two fewer ops and
        passes over the rows per layer."""
        layers = cast("list[DecoderLayer]", list(self.model.layers))
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            post = layer.post_attention_layernorm
            h = add_rms_norm_(x, layer.self_attn(h, cos, sin, meta, kv), post.weight, post.eps)
            if i + 1 < len(layers):
                after = layers[i + 1].input_layernorm
                h = add_rms_norm_(x, layer.mlp(h), after.weight, after.eps)
            else:
                x.add_(layer.mlp(h))
        return x

    def make_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> PagedKVCache:
        weight = self.model.embed_tokens.weight  # in the model dtype also when lm_head is quantized
        return _attention_class(self.config).make_kv_cache(
            self.config, num_blocks, block_size, device or weight.device, dtype or weight.dtype
        )
