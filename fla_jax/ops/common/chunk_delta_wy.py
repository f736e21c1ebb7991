"""Chunk-parallel (gated) delta rule in plain jnp, via the WY / UT transform.

Within a chunk (C tokens, b = inclusive cumsum of the log-decay g, b = 0 without a gate,
S the state entering the chunk) the recurrence
    S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t
unrolls to S_t = exp(b_t) S + sum_{j <= t} exp(b_t - b_j) k_j^T u_j with pseudo-values
    (I + L) U = beta * v - (beta * exp(b) * k) S,
    L[t, j] = beta_t exp(b_t - b_j) (k_t . k_j)  for j < t (strictly lower triangular).
With T = (I + L)^-1 (unit lower triangular, common.unit_lower_inverse): U = X - W S, X = T (beta v),
W = T (beta exp(b) k). Then
    o     = scale * ((exp(b) q) S + ((q k^T) * exp(b_i - b_j) [j <= i]) U)
    S_out = exp(b_C) S + (k * exp(b_C - b))^T U.
X and W are computed for all chunks at once; only the state passes sequentially
(fla_jax.ops.common.chunk_state_scan).
"""
from __future__ import annotations

import jax.numpy as jnp

from .chunk_decay import chunk_cumsum, chunk_suffix, pairwise_decay
from .chunk_packing import (chunk_initial_states, from_chunks, gather_final_states,
                            plan_chunks, to_chunks)
from .chunk_state_scan import scan_chunk_states
from .compute_operands import einsum, prepare_qkv
from .unit_lower_inverse import unit_lower_inverse


def delta_rule_chunks(q, k, v, *, g, beta, scale, initial_state, output_final_state,
                      cu_seqlens, use_qk_l2norm_in_kernel, chunk_size: int):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g: None or [B, T, HV]; beta: [B, T, HV];
    initial_state: None or [N, HV, K, V]; cu_seqlens: None or [N+1] int (may be traced).
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None)."""
    qc, kc, vc = prepare_qkv(q, k, v, use_qk_l2norm_in_kernel)
    cd = qc.dtype
    B, T, HV, K = qc.shape
    V = vc.shape[-1]
    plan = plan_chunks(B, T, cu_seqlens, chunk_size)
    qn, kn, vn = to_chunks(plan, qc), to_chunks(plan, kc), to_chunks(plan, vc)
    bn = to_chunks(plan, beta.astype(cd))[..., None]                  # [B, NC, HV, C, 1]
    NC, C = plan.num_chunks, plan.chunk
    if g is not None:
        gn = to_chunks(plan, g.astype(cd))
        b = chunk_cumsum(gn)                                           # [B, NC, HV, C]
        to_end = chunk_suffix(gn)                                      # b_last - b, directly
    else:
        b = jnp.zeros((plan.lanes, NC, HV, C), cd)
        to_end = b
    b_last = b[..., -1]

    kk = einsum("bnhik,bnhjk->bnhij", kn, kn)
    lower = bn * kk * pairwise_decay(b, inclusive=False)              # strictly lower
    t_inv = unit_lower_inverse(lower)                                 # (I + L)^-1
    x = einsum("bnhij,bnhjv->bnhiv", t_inv, bn * vn)
    w = einsum("bnhij,bnhjk->bnhik", t_inv, bn * jnp.exp(b)[..., None] * kn)

    k_decayed = kn * jnp.exp(to_end)[..., None]
    carry0, reset_states = chunk_initial_states(plan, initial_state, (HV, K, V), cd)
    S_in, S_after, S_last = scan_chunk_states(
        jnp.exp(b_last)[..., None], k_decayed, x, w, carry0,
        reset=plan.reset, reset_states=reset_states,
        collect_after=output_final_state and plan.varlen)

    u = x - einsum("bnhck,bnhkv->bnhcv", w, S_in)
    attn = einsum("bnhik,bnhjk->bnhij", qn, kn) * pairwise_decay(b)
    o = (einsum("bnhck,bnhkv->bnhcv", qn * jnp.exp(b)[..., None], S_in)
         + einsum("bnhij,bnhjv->bnhiv", attn, u))
    o = from_chunks(plan, scale * o).astype(q.dtype)
    if not output_final_state:
        return o, None
    return o, gather_final_states(plan, S_after, S_last, initial_state, (HV, K, V), cd)
