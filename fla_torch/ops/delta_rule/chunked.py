"""Chunk-parallel delta rule in plain torch ops: the gated delta rule's WY / UT-transform
chunking (see gated_delta_rule/chunked.py) with no gate."""
from __future__ import annotations

from ..gated_delta_rule.chunked import delta_chunked


def delta_rule_chunked(q, k, v, beta, scale=1.0, initial_state=None, output_final_state=False,
                       cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV] (HV % H == 0).

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 (fp64 for fp64 q)).
    """
    return delta_chunked(q, k, v, None, beta, scale, initial_state, output_final_state,
                         cu_seqlens, use_qk_l2norm_in_kernel)
