"""Token-by-token RWKV-7 (the oracle for every other implementation), lax.scan over time.

Per head, state S: [K, V] in the compute dtype (fp32, fp64 for fp64 inputs):
    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,    o_t = scale * r_t S_t.
Varlen (cu_seqlens [N+1], B == 1, may be traced): a sequence start replaces the carried
state by initial_state[n]; final_state[n] is the state after sequence n's last token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ... import dtypes
from ..common.compute_operands import compute_dtype
from ..common.token_recurrence import token_sequence_ids


def _step(S, r_t, w_t, k_t, v_t, a_t, b_t, scale, precision):
    """S: [B, H, K, V]; r_t, w_t, k_t, a_t, b_t: [B, H, K]; v_t: [B, H, V]."""
    cd = S.dtype
    aS = jnp.einsum("bhk,bhkv->bhv", a_t, S, precision=precision, preferred_element_type=cd)
    S = (S * jnp.exp(w_t)[..., None] + b_t[..., :, None] * aS[..., None, :]
         + k_t[..., :, None] * v_t[..., None, :])
    o_t = scale * jnp.einsum("bhk,bhkv->bhv", r_t, S, precision=precision,
                             preferred_element_type=cd)
    return S, o_t


def rwkv7_reference(r, k, v, *, w, a, b, scale, initial_state, output_final_state,
                    cu_seqlens):
    """r, k, w, a, b: [B, T, H, K]; v: [B, T, H, V]; w, a, b fp32 (fp64 with fp64 r);
    initial_state: None or [N, H, K, V]; cu_seqlens: None or [N+1] int (may be traced).
    Returns (o [B, T, H, V] in r's dtype, final_state [N, H, K, V] or None)."""
    cd = compute_dtype(r)
    B, T, H, K = r.shape
    V = v.shape[-1]
    precision = dtypes.matmul_precision()
    tm = lambda x: jnp.moveaxis(x.astype(cd), 1, 0)  # time-major, compute dtype
    xs = tuple(tm(x) for x in (r, w, k, v, a, b))
    step = lambda S, x: _step(S, *x, scale, precision)

    if cu_seqlens is None:
        S0 = jnp.zeros((B, H, K, V), cd) if initial_state is None else initial_state.astype(cd)
        final, o = jax.lax.scan(step, S0, xs)
    else:
        N = cu_seqlens.shape[0] - 1
        h0 = jnp.zeros((N, H, K, V), cd) if initial_state is None else initial_state.astype(cd)
        seq_id, starts = token_sequence_ids(cu_seqlens, T)

        def body(carry, x):
            S, finals = carry
            sid, start = x[0], x[1]
            S = jnp.where(start, h0[sid][None], S)
            S, o_t = step(S, x[2:])
            return (S, finals.at[sid].set(S[0])), o_t

        (_, final), o = jax.lax.scan(body, (h0[:1], h0), (seq_id, starts) + xs)
    o = jnp.moveaxis(o, 0, 1).astype(r.dtype)
    return o, (final if output_final_state else None)
