"""chunk_simple_gla in Triton: the engine's scalar-gate chunk scan (common/engine/scan.py,
GATE_SCALAR for g / g_gamma, GATE_NONE without) behind one torch.autograd.Function.

o_i = scale (exp(b_i) q_i S + sum_{j <= i} exp(b_i - b_j) (q_i . k_j) v_j) per chunk of 64, b
the in-chunk cumsum of g + g_gamma, S the state before the chunk (see scan.py). The forward
keeps the per-chunk states only when g needs a gradient (dg reads them).
"""
from __future__ import annotations

import torch

from ..common.engine.scan import scan_bwd, scan_fwd

MAX_HEAD_DIM = 256


class _ChunkSimpleGLA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens,
                need_dg):
        o, ht, h = scan_fwd(q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                            cu_seqlens, store_states=need_dg)
        ctx.save_for_backward(q, k, v, g, g_gamma, initial_state, cu_seqlens, h)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, g_gamma, initial_state, cu_seqlens, h = ctx.saved_tensors
        dq, dk, dv, dg, dh0 = scan_bwd(q, k, v, g, g_gamma, ctx.scale, initial_state,
                                       cu_seqlens, do.contiguous(), _contig(dht), h)
        return dq, dk, dv, dg, None, None, dh0, None, None, None


def _contig(x):
    return None if x is None else x.contiguous()


def _check(q: torch.Tensor, v: torch.Tensor) -> None:
    K, V = q.shape[-1], v.shape[-1]
    for name, size in (("K", K), ("V", V)):
        if size > MAX_HEAD_DIM:
            raise ValueError(f"chunk_simple_gla(impl='triton'): head size {name}={size}; "
                             f"expected {name} <= {MAX_HEAD_DIM}")


def chunk_simple_gla_triton(q, k, v, *, g=None, g_gamma=None, scale=1.0, initial_state=None,
                            output_final_state=False, cu_seqlens=None):
    """Chunked simple GLA (Triton). q, k [B, T, H, K]; v [B, T, H, V] (bf16/fp16/fp32);
    g [B, T, H] fp32 or None; g_gamma [H] fp32 or None; initial_state [N, H, K, V] fp32 or
    None; cu_seqlens [N+1] int or None (B == 1). Returns (o [B, T, H, V] in q's dtype,
    final_state [N, H, K, V] fp32 or None). K, V <= 256."""
    _check(q, v)
    need_dg = g is not None and g.requires_grad and torch.is_grad_enabled()
    return _ChunkSimpleGLA.apply(_contig(q), _contig(k), _contig(v), _contig(g),
                                 _contig(g_gamma), float(scale), _contig(initial_state),
                                 bool(output_final_state), cu_seqlens, need_dg)
