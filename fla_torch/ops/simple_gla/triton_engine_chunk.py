"""Chunked simple GLA on the engine's staged stages (GATE_SCALAR / GATE_NONE: chunk_cumsum,
intra_scores, state_pass, output_fwd / output_bwd, as chunk_gla runs them with GATE_KEY): the
float64 check of those stages' scalar branches (test_triton_engine.py). Not registered:
chunk_simple_gla runs on the engine's fused scan stage (engine/scan.py), 2.9x / 1.45x faster
on the H100 (bf16 fwd / fwd+bwd, benchmarks/RESULTS.md run 10).

The decay is g + g_gamma per token and head ([B, T, H] fp32, formed on the host); no gate
runs GATE_NONE.
"""
from __future__ import annotations

import torch

from ..common.engine import GATE_NONE, GATE_SCALAR, chunk_backward, chunk_forward
from ..common.triton_scalar_gate import dot_precision
from ..common.kernel_alloc import alloc_on, contiguous as _contig


class _EngineSimpleGLA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, gate, scale, initial_state, output_final_state, cu_seqlens):
        prec = dot_precision(q.dtype)
        o, ht, saved = chunk_forward(q, k, v, g, gate, scale, initial_state, output_final_state,
                                     cu_seqlens, prec, alloc_on(q.device))
        ctx.save_for_backward(q, k, v, cu_seqlens, *saved)
        ctx.gate, ctx.scale, ctx.prec = gate, scale, prec
        ctx.has_h0, ctx.has_g = initial_state is not None, g is not None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, cu_seqlens, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dh0 = chunk_backward(
            q, k, v, saved, do.contiguous(), _contig(dht), ctx.gate, ctx.scale, cu_seqlens,
            ctx.has_h0, ctx.has_g and ctx.needs_input_grad[3], ctx.prec, alloc_on(q.device))
        return dq, dk, dv, dg, None, None, dh0, None, None


def chunk_simple_gla_engine(q, k, v, *, g=None, g_gamma=None, scale=1.0, initial_state=None,
                            output_final_state=False, cu_seqlens=None):
    """Same contract as triton_chunk.chunk_simple_gla_triton: q, k [B, T, H, K]; v
    [B, T, H, V]; g [B, T, H] fp32 or None; g_gamma [H] fp32 or None; initial_state
    [N, H, K, V] fp32 or None; cu_seqlens [N+1] int or None. Returns (o, final_state)."""
    if g is not None and g_gamma is not None:
        g = g + g_gamma
    elif g_gamma is not None:
        g = g_gamma.expand(q.shape[:3])
    gate = GATE_NONE.value if g is None else GATE_SCALAR.value
    return _EngineSimpleGLA.apply(_contig(q), _contig(k), _contig(v), _contig(g), gate,
                                  float(scale), _contig(initial_state), bool(output_final_state),
                                  cu_seqlens)
