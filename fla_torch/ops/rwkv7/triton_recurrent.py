"""Token-by-token RWKV-7 in Triton, forward AND backward (torch.autograd.Function).

Per sequence and head (S [K, V] fp32):
    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,   o_t = scale * r_t S_t
The kernels are the shared DPLR stages of ops/common/triton_dplr_recurrent.py (checkpointed
states, exact reverse walk); this file assembles the gradients.
"""
from __future__ import annotations

import torch

from ..common.kernel_alloc import contiguous
from ..common.triton_dplr_recurrent import dplr_backward, dplr_forward


class _RecurrentRWKV7(torch.autograd.Function):

    @staticmethod
    def forward(ctx, r, k, v, w, a, b, h0, scale, output_final_state, cu_seqlens, keep):
        o, ht, ckpt = dplr_forward(False, r, k, v, w, a, b, None, h0, scale,
                                   output_final_state, cu_seqlens, keep, r.dtype)
        ctx.save_for_backward(r, k, v, w, a, b, h0, ckpt, cu_seqlens)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, k, v, w, a, b, h0, ckpt, cu_seqlens = ctx.saved_tensors
        parts, _, dv, dh0 = dplr_backward(False, r, k, v, w, a, b, None, h0, ckpt, ctx.scale,
                                       cu_seqlens, do.contiguous(), contiguous(dht))
        dr, dk, db, da, dw = parts.unbind(0)
        return (dr.to(r.dtype), dk.to(k.dtype), dv, dw, da, db, dh0, None, None, None, None)


def fused_recurrent_rwkv7_triton(r, k, v, *, w, a, b, scale=1.0, initial_state=None,
                                 output_final_state=False, cu_seqlens=None):
    """Token-by-token RWKV-7 (Triton). r, k [B, T, H, K]; v [B, T, H, V] (one dtype in
    bf16/fp16/fp32); w (log-decay), a, b [B, T, H, K] fp32; initial_state [N, H, K, V] fp32 or
    None; cu_seqlens [N+1] int or None (B == 1). Returns (o [B, T, H, V] in r's dtype,
    final_state [N, H, K, V] fp32 or None). K, V <= 256. Gradients: dr, dk, dv in their
    inputs' dtypes; dw, da, db, dh0 fp32."""
    keep = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (r, k, v, w, a, b, initial_state))
    return _RecurrentRWKV7.apply(contiguous(r), contiguous(k), contiguous(v), contiguous(w),
                                 contiguous(a), contiguous(b), contiguous(initial_state),
                                 float(scale), bool(output_final_state), cu_seqlens, keep)
