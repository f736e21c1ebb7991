"""RWKV token shift: each token sees the previous token of its own sequence (mirror of
fla_torch/layers/token_shift.py; static shapes, runs under jit, cu_seqlens may be traced).

The shift state (cache) is the last token's input [N, D] in the compute dtype. With a padding
mask the previous token is the previous real token of the row; with cu_seqlens (B == 1) a
sequence starts from its cache row (or zeros), never from the sequence before.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_shift(x, cache=None, mask=None, cu_seqlens=None):
    """x [B, T, D] -> (prev [B, T, D] the previous token's x, last [N, D] the new cache).

    cache: None (zeros) or [N, D]; N = B, or len(cu_seqlens) - 1 with cu_seqlens.
    mask: None or bool [B, T] (1 = real token)."""
    B, T, D = x.shape
    if cu_seqlens is not None:
        return _shift_varlen(x, cache, cu_seqlens)
    before = jnp.zeros((B, D), x.dtype) if cache is None else cache.astype(x.dtype)
    if mask is None:
        prev = jnp.concatenate([before[:, None], x[:, :-1]], axis=1)
        return prev, x[:, -1]
    t = jnp.arange(T)
    pos = jnp.where(mask, t[None, :], -1)
    last_real = jax.lax.cummax(pos, axis=1)                              # [B, T]
    prev_idx = jnp.concatenate([jnp.full((B, 1), -1, last_real.dtype), last_real[:, :-1]],
                               axis=1)
    gathered = jnp.take_along_axis(x, jnp.maximum(prev_idx, 0)[..., None], axis=1)
    prev = jnp.where((prev_idx >= 0)[..., None], gathered, before[:, None])
    end = last_real[:, -1]
    last = jnp.where((end >= 0)[:, None], x[jnp.arange(B), jnp.maximum(end, 0)], before)
    return prev, last


def _shift_varlen(x, cache, cu_seqlens):
    """x [1, T, D] packed; cache None or [N, D]."""
    _, T, D = x.shape
    N = cu_seqlens.shape[0] - 1
    before = jnp.zeros((N, D), x.dtype) if cache is None else cache.astype(x.dtype)
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    t = jnp.arange(T)
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, N - 1)
    start = cu[seq]
    inside = x[0, jnp.maximum(t - 1, 0)]
    prev = jnp.where((t > start)[:, None], inside, before[seq])[None]
    last = jnp.where((cu[1:] > cu[:-1])[:, None], x[0, jnp.maximum(cu[1:] - 1, 0)], before)
    return prev, last
