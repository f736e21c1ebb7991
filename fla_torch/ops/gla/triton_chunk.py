"""Chunked GLA (per-key gate) in Triton on the chunk engine (fla_torch/ops/common/engine).

Forward: state pass (h [slots, H, K, V], the state before every chunk, and the final state),
then the chunk-parallel output stage. Backward: the reverse state pass (dh, the gradient of
the state after every chunk, and dh0), then the output-stage backward (dq, dk, dv, dg).
h and dh are kept in q's dtype (tensor-core operands; fp32 for fp32 inputs).
No host synchronisation: varlen chunks are found inside the kernels (engine/varlen.py).
"""
from __future__ import annotations

import torch

from ..common.engine import (GATE_KEY, output_bwd, output_fwd, state_pass_bwd,
                             state_pass_fwd)
from ..common.triton_scalar_gate import dot_precision

MAX_HEAD_DIM = 256
# NaN-fill outputs and buffers first when True, or always off the GPU (interpreter tests).
POISON_OUTPUTS = False
_GATE = GATE_KEY.value


def _alloc_on(device):
    def alloc(shape, dtype):
        if POISON_OUTPUTS or device.type != "cuda":
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)
    return alloc


def _contig(x):
    return None if x is None else x.contiguous()


class _ChunkGLA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
        alloc = _alloc_on(q.device)
        prec = dot_precision(q.dtype)
        h, ht = state_pass_fwd(k, v, g, _GATE, initial_state, output_final_state, cu_seqlens,
                               q.dtype, prec, alloc)
        o = output_fwd(q, k, v, g, _GATE, h, scale, cu_seqlens, prec, alloc)
        ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens, h)
        ctx.scale = scale
        ctx.prec = prec
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, initial_state, cu_seqlens, h = ctx.saved_tensors
        alloc = _alloc_on(q.device)
        do = do.contiguous()
        dh, dh0 = state_pass_bwd(q, do, g, _GATE, ctx.scale, _contig(dht), cu_seqlens,
                                 initial_state is not None, q.dtype, ctx.prec, alloc)
        dq, dk, dv, dg = output_bwd(q, k, v, g, _GATE, h, dh, do, ctx.scale, cu_seqlens,
                                    ctx.needs_input_grad[3], ctx.prec, alloc)
        return dq, dk, dv, dg, None, dh0, None, None


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
    if cu_seqlens is not None and cu_seqlens.device != q.device:
        raise ValueError(f"chunk_gla(impl='triton'): cu_seqlens is on {cu_seqlens.device}; "
                         f"expected q's device {q.device}")
    return _ChunkGLA.apply(_contig(q), _contig(k), _contig(v), _contig(g), float(scale),
                           _contig(initial_state), bool(output_final_state), cu_seqlens)
