"""Naive softmax attention: scores, softmax and the value sum in float32 (float64 for float64
inputs, with jax_enable_x64), the [B, HQ, T, S] score matrix materialised."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ... import dtypes
from .mask import allowed_mask


def attention_reference(q, k, v, *, scale: float, causal: bool, window, cu_seqlens=None,
                        key_mask=None, q_offset=None):
    """q: [B, T, HQ, K]; k: [B, S, HKV, K]; v: [B, S, HKV, V] -> o [B, T, HQ, V] in q's dtype."""
    B, T, HQ, _ = q.shape
    S, HKV = k.shape[1], k.shape[2]
    cd = dtypes.gate_dtype(q.dtype)
    prec = dtypes.matmul_precision()
    qf = q.astype(cd)
    kf = jnp.repeat(k.astype(cd), HQ // HKV, axis=2)
    vf = jnp.repeat(v.astype(cd), HQ // HKV, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", qf, kf, precision=prec) * scale
    if causal or window is not None or cu_seqlens is not None or key_mask is not None:
        ok = allowed_mask(T, S, causal, window, cu_seqlens, key_mask, q_offset)
        s = jnp.where(ok[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, vf, precision=prec).astype(q.dtype)
