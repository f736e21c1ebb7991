"""The token-by-token recurrence shared by every reference op (lax.scan over time).

One step, per value head, state S: [K, V] in the compute dtype (fp32, fp64 for fp64 inputs):
    S <- a_t * S                           a_t = exp(log_decay_t), a scalar or a [K] row scale
    S <- S + k_t^T v_t                     (plain / gated linear attention)
    S <- S + beta_t k_t^T (v_t - k_t S)    (delta rule, when beta is given)
    o_t = scale * q_t S
Varlen (cu_seqlens [N+1], B == 1; may be traced under jit): every token knows its sequence
id and whether a sequence starts there; at a start the carried state is replaced by
initial_state[n]; final_state[n] is the state after the last token of sequence n (a
zero-length sequence keeps initial_state[n]).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ... import dtypes


def count_offsets_up_to(offsets, length: int):
    """[length] int32: c[p] = number of entries of `offsets` that are <= p (offsets >= 0,
    may be traced; entries >= length count nowhere). A scatter-add and a cumsum: cheap to
    compile and O(length + len(offsets))."""
    hits = jnp.zeros((length,), jnp.int32).at[offsets].add(1, mode="drop")
    return jnp.cumsum(hits).astype(jnp.int32)


def token_sequence_ids(cu_seqlens, T: int):
    """(seq_id [T] int32, starts [T] bool) for a packed batch; cu_seqlens may be traced.
    Zero-length sequences own no token."""
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    seq_id = count_offsets_up_to(cu[1:-1], T)
    starts = jnp.arange(T, dtype=jnp.int32) == cu[seq_id]
    return seq_id, starts


def _step(S, q_t, k_t, v_t, decay_t, beta_t, scale, precision):
    """S: [B, HV, K, V]; q_t, k_t: [B, HV, K]; v_t: [B, HV, V]; decay_t: [B, HV, 1|K];
    beta_t: [B, HV] or None. Returns (S_t, o_t [B, HV, V])."""
    cd = S.dtype
    if decay_t is not None:
        S = S * jnp.exp(decay_t)[..., None]
    if beta_t is None:
        S = S + k_t[..., :, None] * v_t[..., None, :]
    else:
        kS = jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=precision, preferred_element_type=cd)
        S = S + k_t[..., :, None] * (beta_t[..., None] * (v_t - kS))[..., None, :]
    o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=precision,
                             preferred_element_type=cd)
    return S, o_t


def run_token_recurrence(q, k, v, *, log_decay, beta, scale, initial_state,
                         output_final_state, cu_seqlens, out_dtype):
    """q, k: [B, T, HV, K]; v: [B, T, HV, V]; log_decay: None, [B, T, HV] or [B, T, HV, K];
    beta: None or [B, T, HV]; all in one compute dtype. initial_state: None or [N, HV, K, V].
    Returns (o [B, T, HV, V] in out_dtype, final_state [N, HV, K, V] or None)."""
    B, T, HV, K = q.shape
    V = v.shape[-1]
    cd = q.dtype
    precision = dtypes.matmul_precision()
    if log_decay is not None and log_decay.ndim == 3:
        log_decay = log_decay[..., None]
    tm = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)  # time-major
    xs = (tm(q), tm(k), tm(v), tm(log_decay), tm(beta))

    if cu_seqlens is None:
        S0 = (jnp.zeros((B, HV, K, V), cd) if initial_state is None
              else initial_state.astype(cd))

        def body(S, x):
            return _step(S, *x, scale, precision)

        S_T, o = jax.lax.scan(body, S0, xs)
        final = S_T
    else:
        N = cu_seqlens.shape[0] - 1
        h0 = (jnp.zeros((N, HV, K, V), cd) if initial_state is None
              else initial_state.astype(cd))
        seq_id, starts = token_sequence_ids(cu_seqlens, T)

        def body(carry, x):
            S, finals = carry
            sid, start = x[0], x[1]
            S = jnp.where(start, h0[sid][None], S)
            S, o_t = _step(S, *x[2:], scale, precision)
            finals = finals.at[sid].set(S[0])
            return (S, finals), o_t

        (_, final), o = jax.lax.scan(body, (h0[:1], h0), (seq_id, starts) + xs)
    o = jnp.moveaxis(o, 0, 1).astype(out_dtype)
    return o, (final if output_final_state else None)
