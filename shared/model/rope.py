"""Rotary position embeddings with the scaling variants Llama-family configs use.

Only position-independent variants are supported: their inverse frequencies are fixed at load time,
which is what a paged cache needs (keys are rotated once, when written).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim // 2], attention_scaling applied to cos and sin)."""
    rope_type = params.get("rope_type", "default")
    base = float(params.get("rope_theta", 10000.0))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(params, base, dim, max_position_embeddings)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3, yarn); "
        "dynamic variants change frequencies with the sequence length, which a paged cache cannot follow"
    )


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(params: dict[str, Any], base: float, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = params["factor"]
    original_max = params.get("original_max_position_embeddings") or max_pos
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(params, head_dim, max_position_embeddings)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, rot_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rot_dim]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rot_dim]. Rotates the first rot_dim dims (half-split layout)."""
    rot_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rot_dim] -> cos [T, 1, rot_dim] and sin with its first half negated [T, 1, rot_dim], made once a
    forward for `apply_rotation` in every layer: apply_rotary's eleven small ops a layer become four (full rotary)."""
    half = cos.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.unsqueeze(1), signed_sin.unsqueeze(1)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary bit for bit, from `rotation_tables`' tables: the rolled halves times the signed sin are
    apply_rotary's negated half times sin, since negation is exact. x [T, heads, head_dim]."""
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return x * cos + x.roll(rot_dim // 2, -1) * signed_sin
    x_rot = x[..., :rot_dim]
    return torch.cat((x_rot * cos + x_rot.roll(rot_dim // 2, -1) * signed_sin, x[..., rot_dim:]), dim=-1)
