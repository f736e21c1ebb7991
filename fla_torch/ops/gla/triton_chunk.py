"""Chunked GLA (per-key gate) in Triton on the chunk engine (fla_torch/ops/common/engine).

The engine's stages in order (engine/pipeline.py): the split in-chunk gate cumsum, the state
pass (h [slots, H, K, V], the state before every chunk, and the final state), the intra-chunk
scores A, the chunk-parallel output stage; backward: the reverse state pass (dh, dh0), then
dv / dA, the intra-chunk dq / dk, and dq, dk, dg.
No host synchronisation: varlen chunks are found inside the kernels (engine/varlen.py).
"""
from __future__ import annotations

import torch

from ..common.engine import GATE_KEY, chunk_backward, chunk_forward
from ..common.kernel_alloc import alloc_on, contiguous as _contig
from ..common.triton_scalar_gate import dot_precision

MAX_HEAD_DIM = 256
_GATE = GATE_KEY.value


class _ChunkGLA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens,
                need_backward):
        prec = dot_precision(q.dtype)
        o, ht, saved = chunk_forward(q, k, v, g, _GATE, scale, initial_state, output_final_state,
                                     cu_seqlens, prec, alloc_on(q.device),
                                     need_backward=need_backward)
        ctx.save_for_backward(q, k, v, cu_seqlens, *saved)
        ctx.scale, ctx.prec, ctx.has_h0 = scale, prec, initial_state is not None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, cu_seqlens, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dh0 = chunk_backward(
            q, k, v, saved, do.contiguous(), _contig(dht), _GATE, ctx.scale, cu_seqlens,
            ctx.has_h0, ctx.needs_input_grad[3], ctx.prec, alloc_on(q.device))
        return dq, dk, dv, dg, None, dh0, None, None, None


def chunk_gla_triton(q, k, v, *, g, scale=1.0, initial_state=None, output_final_state=False,
                     cu_seqlens=None):
    """Chunked GLA (Triton). q, k [B, T, H, K]; v [B, T, H, V] (bf16/fp16/fp32); g [B, T, H, K]
    fp32 log-decay; initial_state [N, H, K, V] fp32 or None; cu_seqlens [N+1] int or None
    (B == 1). Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None).
    K, V <= 256."""
    for name, size in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if size > MAX_HEAD_DIM:
            raise ValueError(f"chunk_gla(impl='triton'): head size {name}={size}; "
                             f"expected {name} <= {MAX_HEAD_DIM}")
    need_backward = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, initial_state))
    return _ChunkGLA.apply(_contig(q), _contig(k), _contig(v), _contig(g), float(scale),
                           _contig(initial_state), bool(output_final_state), cu_seqlens,
                           need_backward)
