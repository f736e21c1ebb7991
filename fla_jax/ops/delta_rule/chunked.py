"""Chunk-parallel delta rule in plain jnp (jit-able, differentiable by autodiff).

The WY / UT-transform algorithm lives in fla_jax.ops.common.chunk_delta_wy (shared with the
gated delta rule); here the log-decay is absent (b = 0).
"""
from __future__ import annotations

from ..common.chunk_delta_wy import delta_rule_chunks

CHUNK_SIZE = 64


def delta_rule_chunked(q, k, v, *, beta, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm_in_kernel=False, chunk_size: int = CHUNK_SIZE):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0); beta: [B, T, HV] fp32/fp64;
    initial_state: None or [N, HV, K, V]; cu_seqlens: None or [N+1] int (may be traced).
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None)."""
    return delta_rule_chunks(q, k, v, g=None, beta=beta, scale=scale,
                             initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             chunk_size=chunk_size)
