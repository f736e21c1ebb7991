"""Chunked delta rule as Mosaic GPU kernels: the gated delta rule kernels without a gate."""
from __future__ import annotations

from ..gated_delta_rule.mosaic_chunk import chunk_gated_delta_rule_mosaic


def chunk_delta_rule_mosaic(q, k, v, *, beta, scale, initial_state, output_final_state,
                            cu_seqlens, use_qk_l2norm_in_kernel=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (bf16/fp16); beta: [B, T, HV] fp32;
    initial_state None or [N, HV, K, V] fp32; cu_seqlens None or int [N+1]. Returns
    (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None). Hopper only;
    differentiable (Pallas backward kernels)."""
    return chunk_gated_delta_rule_mosaic(
        q, k, v, g=None, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, op="chunk_delta_rule")
