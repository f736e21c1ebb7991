"""The chunk-local gate gradient from the Mosaic backward kernels' per-row terms.

The gradient kernels (simple GLA, the delta family) write two per-row terms, each scaling with
the decay it differentiates: r1 (the terms of rows s >= t reach g_t) and r2 (the state-update
keys, whose terms of rows s < t reach g_t). Then, within each chunk of `chunk` rows,
    dg_t = sum_{s >= t} r1_s + sum_{s < t} r2_s,
two masked sums; never a chunk total minus a prefix (that cancels O(1) terms and lost every
digit under gates of -10..-20 per token).
"""
from __future__ import annotations

import jax.numpy as jnp


def chunk_gate_grad(r1, r2, chunk: int):
    """r1, r2: [..., R] fp32 (R a multiple of `chunk`, chunks of consecutive rows) -> dg
    [..., R] fp32."""
    shape = r1.shape
    a = r1.reshape(*shape[:-1], shape[-1] // chunk, chunk)
    b = r2.reshape(a.shape)
    dg = jnp.flip(jnp.cumsum(jnp.flip(a, -1), axis=-1), -1) + (jnp.cumsum(b, axis=-1) - b)
    return dg.reshape(shape)
