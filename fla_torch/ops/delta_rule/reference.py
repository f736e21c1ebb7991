"""Token-by-token delta rule (the oracle; works in float64).

Per sequence and value head hv (reading q/k head hv // (HV // H)), S: [K, V] starting at
initial_state (or 0):
    S_t = (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t
    o_t = scale * q_t S_t
With use_qk_l2norm_in_kernel, q and k are first l2-normalised over K in fp32.
"""
from __future__ import annotations

from ..gated_delta_rule.reference import gated_delta_rule_reference


def delta_rule_reference(q, k, v, beta, scale=1.0, initial_state=None, output_final_state=False,
                         cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV] (HV % H == 0).

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 (fp64 for fp64 q)).
    The gated delta rule with no gate (g = None).
    """
    return gated_delta_rule_reference(q, k, v, None, beta, scale=scale,
                                      initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      cu_seqlens=cu_seqlens,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
