"""Token-by-token Gated Slot Attention (the oracle; lax.scan over time).

Per sequence and query head (hk: [K, M], hv: [M, V], starting at initial_state or 0):
    hk_t = hk_{t-1} diag(exp(g_t)) + k_t^T s_t ;  ok_t = scale * q_t hk_t
    p_t  = softmax(ok_t)
    hv_t = diag(exp(g_t)) hv_{t-1} + s_t^T v_t ;  o_t  = p_t hv_t
Varlen: a sequence start replaces the carried state by initial_state[n]; a zero-length
sequence keeps its initial state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ... import dtypes
from ..common.token_recurrence import token_sequence_ids
from .slot_inputs import group_final, gsa_operands


def _scan(xs, h0, cu_seqlens, shape, step):
    """xs: token-major [B, T, HQ, *] tensors; h0: None or [N, *shape]; step(S, x_t) ->
    (S, o_t). Returns (o [B, T, HQ, *], final [N, *shape])."""
    B, T = xs[0].shape[:2]
    cd = xs[0].dtype
    tm = tuple(jnp.moveaxis(x, 1, 0) for x in xs)
    if cu_seqlens is None:
        S0 = jnp.zeros((B,) + shape, cd) if h0 is None else h0.astype(cd)
        final, o = jax.lax.scan(lambda S, x: step(S, x), S0, tm)
    else:
        N = cu_seqlens.shape[0] - 1
        h0 = jnp.zeros((N,) + shape, cd) if h0 is None else h0.astype(cd)
        seq_id, starts = token_sequence_ids(cu_seqlens, T)

        def body(carry, x):
            S, finals = carry
            S = jnp.where(x[1], h0[x[0]][None], S)
            S, o_t = step(S, x[2:])
            return (S, finals.at[x[0]].set(S[0])), o_t

        (_, final), o = jax.lax.scan(body, (h0[:1], h0), (seq_id, starts) + tm)
    return jnp.moveaxis(o, 0, 1), final


def gsa_reference(q, k, v, s, *, g=None, scale, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    """q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]; s, g: [B, T, H, M] (g None: FLA's
    additive gate from s). initial_state: None or (hk0 [N, H, K, M] | None,
    hv0 [N, H, M, V] | None).

    Returns (o [B, T, HQ, V] in q's dtype, (hk [N, H, K, M], hv [N, H, M, V]) fp32 (fp64 for
    fp64 q) or None)."""
    qf, kf, vf, sf, gf, hk0, hv0, NG = gsa_operands(q, k, v, s, g, initial_state, cu_seqlens)
    HQ, K, V, M = qf.shape[2], qf.shape[3], vf.shape[3], sf.shape[3]
    prec = dtypes.matmul_precision()
    cd = qf.dtype

    def slot_step(S, x):
        q_t, k_t, s_t, g_t = x
        S = S * jnp.exp(g_t)[..., None, :] + k_t[..., :, None] * s_t[..., None, :]
        return S, scale * jnp.einsum("bhk,bhkm->bhm", q_t, S, precision=prec,
                                     preferred_element_type=cd)

    def value_step(S, x):
        p_t, s_t, v_t, g_t = x
        S = jnp.exp(g_t)[..., :, None] * S + s_t[..., :, None] * v_t[..., None, :]
        return S, jnp.einsum("bhm,bhmv->bhv", p_t, S, precision=prec, preferred_element_type=cd)

    ok, hk = _scan((qf, kf, sf, gf), hk0, cu_seqlens, (HQ, K, M), slot_step)
    o, hv = _scan((jax.nn.softmax(ok, axis=-1), sf, vf, gf), hv0, cu_seqlens, (HQ, M, V),
                  value_step)
    final = (group_final(hk, NG), group_final(hv, NG)) if output_final_state else None
    return o.astype(q.dtype), final
