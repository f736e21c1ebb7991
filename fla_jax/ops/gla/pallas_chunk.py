"""Chunked GLA (per-key-channel log-decay) as Pallas kernels: the chunk engine with GATE_KEY
(fla_jax/ops/common/engine; its stages in order in engine/pipeline.py).
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.engine import GATE_KEY, engine_chunk, make_problem


def chunk_gla_pallas(q, k, v, *, g, scale, initial_state=None, output_final_state=False,
                     cu_seqlens=None):
    """Pallas (Triton lowering) chunked GLA; runs interpreted off-GPU.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in bf16/fp16/fp32 (K, V <= 256).
        g: fp32 [B, T, H, K] log-decay (<= 0). scale: float.
        initial_state: None or fp32 [N, H, K, V]. cu_seqlens: None or int [N+1] (B == 1),
        may be traced.
    Returns:
        o [B, T, H, V] in q's dtype; final state fp32 [N, H, K, V] or None.
    Differentiable w.r.t. q, k, v, g (fp32 cotangent) and initial_state.
    """
    pb = make_problem(q, v, g, initial_state, cu_seqlens, scale, GATE_KEY)
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    o, ht = engine_chunk(pb, q, k, v, g.astype(jnp.float32), initial_state, cu)
    return o, (ht if output_final_state else None)


__all__ = ["chunk_gla_pallas"]
