"""Chunk-parallel diagonal-plus-low-rank (DPLR) recurrence in plain jnp (RWKV-7, KDA).

Per head, state S: [K, V], per token w_t, a_t, b_t, k_t in R^K, v_t in R^V:
    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,     o_t = r_t S_t.
Within a chunk (C tokens, S the state entering it, g = inclusive cumsum of w over the chunk,
e = exclusive cumsum, u_t = a_t^T S_{t-1} in R^V):
    S_t = exp(g_t) S + sum_{j <= t} exp(g_t - g_j) (b_j u_j^T + k_j v_j^T)
    u_i = (a_i exp(e_i)) S + sum_{j < i} [a_i exp(e_i - g_j) . b_j] u_j + [.. . k_j] v_j
so with the strictly lower scores A_ab, A_ak and T = (I - A_ab)^-1 (unit lower triangular):
    U = X - W S,   X = T (A_ak V),   W = -T (a exp(e))
    o = (r exp(g)) S + A_rb U + A_rk V                  (A_rb, A_rk: j <= i)
    S_out = exp(g_C) S + (b exp(g_C - g))^T U + (k exp(g_C - g))^T V.
Every exponent is <= 0: pairwise gaps are masked before exp, and the zero-length gaps
(j = i - 1 in A_ab, A_ak; j = i in A_rb, A_rk) are the constant 1, never exp(x - x), so no
O(1) gradient term is formed and cancelled; the gaps to the chunk's end are direct suffix
sums. Only the [K, V] state passes sequentially (common.chunk_state_scan).
"""
from __future__ import annotations

import jax.numpy as jnp

from ... import dtypes
from .chunk_decay import causal_mask, chunk_cumsum, chunk_suffix
from .chunk_packing import (chunk_initial_states, from_chunks, gather_final_states,
                            plan_chunks, to_chunks)
from .chunk_state_scan import scan_chunk_states
from .compute_operands import einsum
from .unit_lower_inverse import unit_lower_inverse


def _exclusive_cumsum(w):
    """sum_{s < i} w_s over the chunk axis: w [B, NC, HV, C, K]."""
    C = w.shape[3]
    tri = causal_mask(C, inclusive=False).astype(w.dtype)
    return jnp.einsum("bnhjk,ij->bnhik", w, tri, precision=dtypes.matmul_precision(),
                      preferred_element_type=w.dtype)


def pair_scores(x, y, ex, ey, shift: int):
    """x, y, ex, ey: [B, NC, HV, C, K] -> [B, NC, HV, C, C]:
    sum_c x_ic y_jc d_ijc with d = 1 at j == i - shift, exp(ex_i - ey_j) at j < i - shift,
    0 elsewhere (masked before exp). The leading axes are folded into one (tensors of at most
    4 axes: XLA:CPU's YNNPACK fusions of jaxlib 0.10.2 segfault on some high-rank ones, see
    gla/chunked.py)."""
    *lead, C, K = x.shape
    x, y, ex, ey = (t.reshape(-1, C, K) for t in (x, y, ex, ey))
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    gap = (j < i - shift)[..., None]
    zero = (j == i - shift).astype(x.dtype)[..., None]
    diff = jnp.where(gap, ex[..., :, None, :] - ey[..., None, :, :], 0.0)
    d = jnp.where(gap, jnp.exp(diff), 0.0) + zero
    return jnp.sum(x[..., :, None, :] * y[..., None, :, :] * d, axis=-1).reshape(*lead, C, C)


def dplr_chunks(r, w, k, v, a, b, *, scale, initial_state, output_final_state, cu_seqlens,
                chunk_size: int):
    """r, w, k, a, b: [B, T, HV, K]; v: [B, T, HV, V]; all in one compute dtype (fp32 or
    fp64); initial_state: None or [N, HV, K, V]; cu_seqlens: None or [N+1] int (may be
    traced). Returns (o [B, T, HV, V] in the compute dtype, final_state [N, HV, K, V] or
    None)."""
    cd = r.dtype
    B, T, HV, K = r.shape
    V = v.shape[-1]
    plan = plan_chunks(B, T, cu_seqlens, chunk_size)
    rn, wn, kn, vn, an, bn = (to_chunks(plan, x) for x in (r, w, k, v, a, b))
    g = chunk_cumsum(wn)                                               # [B, NC, HV, C, K]
    e = _exclusive_cumsum(wn)
    to_end = chunk_suffix(wn)                                          # g_C - g, directly

    a_ab = pair_scores(an, bn, e, g, 1)
    a_ak = pair_scores(an, kn, e, g, 1)
    a_rb = pair_scores(rn, bn, g, g, 0)
    a_rk = pair_scores(rn, kn, g, g, 0)
    t_inv = unit_lower_inverse(-a_ab)                                  # (I - A_ab)^-1
    x = einsum("bnhij,bnhjv->bnhiv", t_inv, einsum("bnhij,bnhjv->bnhiv", a_ak, vn))
    wq = -einsum("bnhij,bnhjk->bnhik", t_inv, an * jnp.exp(e))

    decayed = jnp.exp(to_end)
    kd = jnp.concatenate([bn * decayed, kn * decayed], axis=3)         # [B, NC, HV, 2C, K]
    xs = jnp.concatenate([x, vn], axis=3)
    ws = jnp.concatenate([wq, jnp.zeros_like(wq)], axis=3)
    carry0, reset_states = chunk_initial_states(plan, initial_state, (HV, K, V), cd)
    S_in, S_after, S_last = scan_chunk_states(
        jnp.exp(g[..., -1, :]), kd, xs, ws, carry0, reset=plan.reset,
        reset_states=reset_states, collect_after=output_final_state and plan.varlen)

    u = x - einsum("bnhck,bnhkv->bnhcv", wq, S_in)
    o = (einsum("bnhck,bnhkv->bnhcv", rn * jnp.exp(g), S_in)
         + einsum("bnhij,bnhjv->bnhiv", a_rb, u) + einsum("bnhij,bnhjv->bnhiv", a_rk, vn))
    o = from_chunks(plan, scale * o)
    if not output_final_state:
        return o, None
    return o, gather_final_states(plan, S_after, S_last, initial_state, (HV, K, V), cd)
