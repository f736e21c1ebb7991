"""Rotary position embedding without parameters (mirror of fla_torch/layers/rotary.py)."""
from __future__ import annotations

import jax.numpy as jnp


def apply_rotary(x, offset, base: float = 10000.0):
    """x: [B, T, H, D] (D even) at positions offset .. offset + T - 1 (offset may be traced)
    -> same shape and dtype. Computed in float32."""
    B, T, H, D = x.shape
    if D % 2 != 0:
        raise ValueError(f"rotary: head size D={D}; expected an even size")
    inv_freq = 1.0 / (base ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    pos = jnp.arange(T, dtype=jnp.float32) + jnp.asarray(offset, jnp.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def retention_log_decay(num_heads: int):
    """RetNet's fixed per-head log-decay [H], float32: log(1 - 2 ** (-5 - h))."""
    h = jnp.arange(num_heads, dtype=jnp.float32)
    return jnp.log1p(-jnp.power(2.0, -5.0 - h))
