"""chunk_gated_delta_rule in Triton: the engine's scalar-gate delta rule
(common/engine/scalar_delta.py: WY / UT transform, chunk states, output; GATE_SCALAR with g,
GATE_NONE for chunk_delta_rule) behind one torch.autograd.Function.
use_qk_l2norm_in_kernel: q, k are normalised in fp32 by common/triton_l2norm.py (fused forward
and backward) and handed to the kernels in the input dtype.
"""
from __future__ import annotations

import torch

from ..common.engine.scalar_delta import delta_backward, delta_forward
from ..common.triton_l2norm import l2norm_triton


class ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens):
        o, ht, saved = delta_forward(q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens)
        ctx.save_for_backward(*saved)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        dq, dk, dv, dg, dbeta, dh0 = delta_backward(ctx.saved_tensors, do, dht, ctx.scale)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None


def chunk_gated_delta_rule_triton(q, k, v, *, g, beta, scale, initial_state, output_final_state,
                                  cu_seqlens, use_qk_l2norm_in_kernel):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0), one dtype in bf16/fp16/fp32;
    g (None = delta rule), beta: [B, T, HV] fp32; initial_state: None or [N, HV, K, V] fp32;
    cu_seqlens: None or [N+1] int (B == 1). Returns (o [B, T, HV, V] in q's dtype,
    final_state [N, HV, K, V] fp32 or None)."""
    if use_qk_l2norm_in_kernel:
        q = l2norm_triton(q)
        k = l2norm_triton(k)
    return ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, float(scale),
                                     bool(output_final_state), cu_seqlens)
