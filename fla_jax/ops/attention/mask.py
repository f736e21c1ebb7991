"""Which keys each query may attend: one boolean mask for every attention path (the rules of
fla_torch/ops/attention/mask.py)."""
from __future__ import annotations

import jax.numpy as jnp


def needs_mask(T: int, S: int, causal: bool, window, cu_seqlens, key_mask) -> bool:
    """False when plain causal (T == S) or full attention describes the call."""
    return (window is not None or cu_seqlens is not None or key_mask is not None
            or (causal and T != S))


def allowed_mask(T: int, S: int, causal: bool, window, cu_seqlens=None, key_mask=None,
                 q_offset=None):
    """bool [B or 1, T, S], True where query t may attend key s.

    Query t sits at position p = t + S - T, or q_offset + t when given (an int, or an int
    scalar that may be traced: the first query's slot in a preallocated KV cache).
    causal: s <= p; window (left, right), -1 = unbounded: p - left <= s <= p + right; cu_seqlens
    [N+1] (T == S, may be traced): s in t's sequence; key_mask bool [B, S] (False = padding):
    padded keys are skipped except by the query at the same position, so a padded query's row is
    never empty."""
    pq = jnp.arange(T)[:, None] + ((S - T) if q_offset is None else q_offset)
    pk = jnp.arange(S)[None, :]
    ok = jnp.ones((T, S), bool)
    if causal:
        ok &= pk <= pq
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= pk >= pq - left
        if right >= 0:
            ok &= pk <= pq + right
    if cu_seqlens is not None:
        cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
        seq = jnp.clip(jnp.searchsorted(cu[1:], jnp.arange(T), side="right"), 0,
                       cu.shape[0] - 2)
        ok &= seq[:, None] == seq[None, :]
    ok = ok[None]
    if key_mask is not None:
        ok = ok & (key_mask[:, None, :] | (pk == pq)[None])
    return ok
