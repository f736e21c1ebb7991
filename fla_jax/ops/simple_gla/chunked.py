"""Chunk-parallel simple GLA in plain jnp (jit-able, differentiable by autodiff).

Per chunk of C tokens with b = inclusive cumsum of the log-decay (g + g_gamma) and S the
state entering the chunk:
    o     = scale * ((exp(b) * q) S + ((q k^T) * exp(b_i - b_j) [j <= i]) v)
    S_out = exp(b_C) S + (k * exp(b_C - b))^T v
The state passes from chunk to chunk in fla_jax.ops.common.chunk_state_scan.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.chunk_decay import chunk_cumsum, chunk_suffix, pairwise_decay
from ..common.chunk_packing import (chunk_initial_states, from_chunks, gather_final_states,
                                    plan_chunks, to_chunks)
from ..common.chunk_state_scan import scan_chunk_states
from ..common.compute_operands import einsum, prepare_qkv

CHUNK_SIZE = 64


def simple_gla_chunked(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state,
                       cu_seqlens, chunk_size: int = CHUNK_SIZE):
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: None or [B, T, H]; g_gamma: None or [H];
    initial_state: None or [N, H, K, V]; cu_seqlens: None or [N+1] int (may be traced).
    Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)."""
    qc, kc, vc = prepare_qkv(q, k, v)
    cd = qc.dtype
    B, T, HV, K = qc.shape
    V = vc.shape[-1]
    plan = plan_chunks(B, T, cu_seqlens, chunk_size)
    qn, kn, vn = to_chunks(plan, qc), to_chunks(plan, kc), to_chunks(plan, vc)
    NC, C = plan.num_chunks, plan.chunk

    log_decay = None if g is None else g.astype(cd)                 # [B, T, H]
    if g_gamma is not None:
        gamma = jnp.broadcast_to(g_gamma.astype(cd), (B, T, HV))
        log_decay = gamma if log_decay is None else log_decay + gamma
    if log_decay is not None:   # padded slots get log-decay 0: they leave the state alone
        gn = to_chunks(plan, log_decay)
        b = chunk_cumsum(gn)                                         # [B, NC, H, C]
        to_end = chunk_suffix(gn)                                    # b_last - b, directly
    else:
        b = jnp.zeros((plan.lanes, NC, HV, C), cd)
        to_end = b
    b_last = b[..., -1]                                           # [B, NC, HV]

    attn = einsum("bnhik,bnhjk->bnhij", qn, kn) * pairwise_decay(b)
    o_intra = einsum("bnhij,bnhjv->bnhiv", attn, vn)
    k_decayed = kn * jnp.exp(to_end)[..., None]

    carry0, reset_states = chunk_initial_states(plan, initial_state, (HV, K, V), cd)
    S_in, S_after, S_last = scan_chunk_states(
        jnp.exp(b_last)[..., None], k_decayed, vn, None, carry0,
        reset=plan.reset, reset_states=reset_states,
        collect_after=output_final_state and plan.varlen)
    o_inter = einsum("bnhck,bnhkv->bnhcv", qn * jnp.exp(b)[..., None], S_in)
    o = from_chunks(plan, scale * (o_inter + o_intra)).astype(q.dtype)
    if not output_final_state:
        return o, None
    return o, gather_final_states(plan, S_after, S_last, initial_state, (HV, K, V), cd)
