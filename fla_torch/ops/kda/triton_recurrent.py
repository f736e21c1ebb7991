"""Token-by-token Kimi Delta Attention in Triton, forward AND backward
(torch.autograd.Function), with grouped value heads (HV % H == 0).

Per sequence and value head hv, reading q/k head hv // (HV // H) (S [K, V] fp32):
    S' = diag(exp(g_t)) S_{t-1};  S_t = S' + beta_t k_t (v_t - k_t^T S');  o_t = scale q_t S_t
The kernels are the shared DPLR stages of ops/common/triton_dplr_recurrent.py (checkpointed
states, exact reverse walk); they give dq, dk per value head, summed here over the value heads
of each q/k head. use_qk_l2norm_in_kernel normalises q and k in fp32 with torch ops before the
kernels (autograd carries the gradient through it).
"""
from __future__ import annotations

import torch

from ..common.kernel_alloc import contiguous
from ..common.l2norm import l2norm
from ..common.qk_inputs import group_sum
from ..common.triton_dplr_recurrent import dplr_backward, dplr_forward


class _RecurrentKDA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens, o_dtype,
                keep):
        o, ht, ckpt = dplr_forward(True, q, k, v, g, None, None, beta, h0, scale,
                                   output_final_state, cu_seqlens, keep, o_dtype)
        ctx.save_for_backward(q, k, v, g, beta, h0, ckpt, cu_seqlens)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, ckpt, cu_seqlens = ctx.saved_tensors
        H = q.shape[2]
        parts, dbeta, dv, dh0 = dplr_backward(True, q, k, v, g, None, None, beta, h0, ckpt,
                                              ctx.scale, cu_seqlens, do.contiguous(),
                                              contiguous(dht))
        dq, dk, dg = parts.unbind(0)
        return (group_sum(dq, H).to(q.dtype), group_sum(dk, H).to(k.dtype), dv, dg, dbeta,
                dh0, None, None, None, None, None)


def fused_recurrent_kda_triton(q, k, v, *, g, beta, scale, initial_state=None,
                               output_final_state=False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False):
    """Token-by-token KDA (Triton). q, k [B, T, H, K]; v [B, T, HV, V] (HV % H == 0), one
    dtype in bf16/fp16/fp32; g [B, T, HV, K] log-decay and beta [B, T, HV] fp32;
    initial_state [N, HV, K, V] fp32 or None; cu_seqlens [N+1] int or None (B == 1).
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None).
    K, V <= 256. Gradients: dq, dk, dv in their inputs' dtypes; dg, dbeta, dh0 fp32."""
    o_dtype = q.dtype
    keep = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    return _RecurrentKDA.apply(contiguous(q), contiguous(k), contiguous(v), contiguous(g),
                               contiguous(beta), contiguous(initial_state), float(scale),
                               bool(output_final_state), cu_seqlens, o_dtype, keep)
