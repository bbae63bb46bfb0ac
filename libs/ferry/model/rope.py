"""Rotary position embedding: inverse frequencies (plain, linear, Llama-3, YaRN) and their application.

The formulas follow the published descriptions (Llama-3 smoothed wavelength scaling; YaRN's
NTK-by-parts ramp with an attention factor that scales cos/sin).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq_and_scale(
    dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim/2] float32, attention factor multiplying cos/sin)."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]
    if scaling is None:
        return base, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return base / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(base, scaling), 1.0
    if kind == "factors":  # a GGUF's rope_freqs: the Llama-3 scaling as divisors, one per frequency
        return base / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_positions)
    raise ValueError(f"rope_scaling: unsupported rope_type {kind!r}")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated, short ones kept, the band between smoothly blended
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    orig = s.get("original_max_position_embeddings") or max_positions
    factor = s.get("factor") or max_positions / orig
    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # 1 = keep the original frequency (high-frequency dims)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


class Rotary(torch.nn.Module):
    """Precomputes nothing per position: cos/sin come from positions on each call (positions are sparse)."""

    inv_freq: torch.Tensor  # [dim/2], a buffer

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int) -> None:
        super().__init__()
        inv_freq, self.attention_factor = inv_freq_and_scale(dim, theta, scaling, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dim/2]
        return ((freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2]. Interleaved input pairs (x0,x1),(x2,x3).. come out de-interleaved,
    which is fine because queries and keys get the same permutation."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
