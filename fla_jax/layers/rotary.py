"""Rotary position embedding without parameters (mirror of fla_torch/layers/rotary.py)."""
from __future__ import annotations

import jax.numpy as jnp


def rotary_positions(B: int, T: int, offset, cu_seqlens=None):
    """float32 positions [B, T]. offset: int / int scalar, or an int array [B] (or [N] with
    cu_seqlens) of tokens already consumed per row / sequence. With cu_seqlens (B == 1)
    positions restart at each sequence start."""
    t = jnp.arange(T)
    offset = jnp.asarray(offset)
    if cu_seqlens is not None:
        seq = jnp.clip(jnp.searchsorted(cu_seqlens[1:], t, side="right"), 0,
                       cu_seqlens.shape[0] - 2)
        pos = (t - cu_seqlens[seq]).astype(jnp.float32)
        pos = pos + (offset[seq] if offset.ndim == 1 else offset).astype(jnp.float32)
        return jnp.broadcast_to(pos[None], (B, T))
    if offset.ndim == 1:
        return offset[:, None].astype(jnp.float32) + t[None].astype(jnp.float32)
    return jnp.broadcast_to((t + offset).astype(jnp.float32)[None], (B, T))


def apply_rotary(x, positions, base: float = 10000.0):
    """x: [B, T, H, D] (D even) at float32 positions [B, T] -> same shape and dtype, computed
    in float32 (rotate-half layout)."""
    B, T, H, D = x.shape
    if D % 2 != 0:
        raise ValueError(f"rotary: head size D={D}; expected an even size")
    inv_freq = 1.0 / (base ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    freqs = positions[..., None] * inv_freq                      # [B, T, D/2]
    cos, sin = jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def retention_log_decay(num_heads: int):
    """RetNet's fixed per-head log-decay [H], float32: log(1 - 2 ** (-5 - h))."""
    h = jnp.arange(num_heads, dtype=jnp.float32)
    return jnp.log1p(-jnp.power(2.0, -5.0 - h))
