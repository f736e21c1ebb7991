"""Token-by-token GLA (the oracle for every other implementation).

Per head: S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t  (g_t in R^K),  o_t = scale * q_t S_t.
Computed in fp32 (fp64 for fp64 inputs); output in q's dtype; states fp32 (fp64).
"""
from __future__ import annotations

from ..common.compute_operands import prepare_qkv
from ..common.token_recurrence import run_token_recurrence


def gla_reference(q, k, v, *, g, scale, initial_state, output_final_state, cu_seqlens):
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] (fp32/fp64);
    initial_state: None or [N, H, K, V]; cu_seqlens: None or [N+1] int.
    Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)."""
    qc, kc, vc = prepare_qkv(q, k, v)
    return run_token_recurrence(qc, kc, vc, log_decay=g.astype(qc.dtype), beta=None,
                                scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens, out_dtype=q.dtype)
