"""Token-by-token simple GLA (the oracle for every other implementation).

Per head: S_t = exp(g_t + gamma) S_{t-1} + k_t^T v_t,  o_t = scale * q_t S_t  (S: [K, V]).
Computed in fp32 (fp64 for fp64 inputs); output in q's dtype; states fp32 (fp64).
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.compute_operands import prepare_qkv
from ..common.token_recurrence import run_token_recurrence


def simple_gla_reference(q, k, v, *, g, g_gamma, scale, initial_state, output_final_state,
                         cu_seqlens):
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: None or [B, T, H]; g_gamma: None or [H]
    (fp32/fp64); initial_state: None or [N, H, K, V]; cu_seqlens: None or [N+1] int.
    Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)."""
    qc, kc, vc = prepare_qkv(q, k, v)
    log_decay = None
    if g is not None:
        log_decay = g.astype(qc.dtype)
    if g_gamma is not None:
        gamma = g_gamma.astype(qc.dtype)[None, None, :]
        log_decay = gamma if log_decay is None else log_decay + gamma
        log_decay = jnp.broadcast_to(log_decay, qc.shape[:3])  # [B, T, H]
    return run_token_recurrence(qc, kc, vc, log_decay=log_decay, beta=None, scale=scale,
                                initial_state=initial_state,
                                output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens, out_dtype=q.dtype)
