"""Token-by-token Kimi Delta Attention (the oracle for every other implementation).

Per value head hv (q/k head hv // (HV // H)), g_t in R^K:
    S' = diag(exp(g_t)) S_{t-1};  S_t = S' + beta_t k_t (v_t - k_t^T S');  o_t = scale q_t S_t.
Computed in fp32 (fp64 for fp64 inputs); output in q's dtype; states fp32 (fp64).
"""
from __future__ import annotations

from ..common.compute_operands import prepare_qkv
from ..common.token_recurrence import run_token_recurrence


def kda_reference(q, k, v, *, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                  use_qk_l2norm_in_kernel=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K], beta: [B, T, HV] (fp32/fp64);
    initial_state: None or [N, HV, K, V]; cu_seqlens: None or [N+1] int (may be traced).
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None)."""
    qc, kc, vc = prepare_qkv(q, k, v, use_qk_l2norm_in_kernel)
    return run_token_recurrence(qc, kc, vc, log_decay=g.astype(qc.dtype),
                                beta=beta.astype(qc.dtype), scale=scale,
                                initial_state=initial_state,
                                output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens, out_dtype=q.dtype)
