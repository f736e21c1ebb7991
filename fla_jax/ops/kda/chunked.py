"""Chunk-parallel Kimi Delta Attention in plain jnp (jit-able, autodiff, fp64-capable).

KDA is the DPLR recurrence of fla_jax.ops.common.dplr_chunked with
    w = g,  k -> beta k (the write key),  b = -beta k,  a = exp(g) k,  r = q:
S_t = diag(exp(g_t)) S + (-beta_t k_t)(k_t^T diag(exp(g_t)) S) + beta_t k_t v_t^T.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.dplr_chunked import dplr_chunks
from ..common.compute_operands import prepare_qkv

CHUNK_SIZE = 32


def kda_chunked(q, k, v, *, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel=False, chunk_size: int = CHUNK_SIZE):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0); g: [B, T, HV, K] and
    beta: [B, T, HV] fp32 (fp64 with fp64 q); initial_state: None or [N, HV, K, V];
    cu_seqlens: None or [N+1] int (may be traced).
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None)."""
    qc, kc, vc = prepare_qkv(q, k, v, use_qk_l2norm_in_kernel)
    cd = qc.dtype
    g = g.astype(cd)
    bk = beta.astype(cd)[..., None] * kc
    o, final = dplr_chunks(qc, g, bk, vc, jnp.exp(g) * kc, -bk, scale=scale,
                           initial_state=initial_state, output_final_state=output_final_state,
                           cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return o.astype(q.dtype), final
