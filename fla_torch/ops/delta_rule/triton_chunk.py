"""Chunked delta rule in Triton (WY / UT transform): the engine's scalar-gate delta rule
(common/engine/scalar_delta.py) with GATE_NONE, through chunk_gated_delta_rule_triton."""
from __future__ import annotations

from ..gated_delta_rule.triton_chunk import chunk_gated_delta_rule_triton


def chunk_delta_rule_triton(q, k, v, *, beta, scale, initial_state, output_final_state,
                            cu_seqlens, use_qk_l2norm_in_kernel):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0), one dtype in bf16/fp16/fp32;
    beta: [B, T, HV] fp32; initial_state: None or [N, HV, K, V] fp32; cu_seqlens: None or
    [N+1] int (B == 1). Returns (o [B, T, HV, V] in q's dtype, final_state fp32 or None)."""
    return chunk_gated_delta_rule_triton(
        q, k, v, g=None, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
