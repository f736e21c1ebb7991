"""chunk_simple_gla in Pallas (Triton lowering): the engine's scalar-gate chunk scan
(common/engine/scan.py: GATE_SCALAR for g / g_gamma, GATE_NONE without) as one custom_vjp.

o_i = scale (exp(b_i) q_i S + sum_{j <= i} exp(b_i - b_j) (q_i . k_j) v_j) per chunk, b the
in-chunk cumsum of g + g_gamma, S the state before the chunk (see scan.py).
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.engine.scan import SCAN_KERNELS, make_static, scan_vjp


def chunk_simple_gla_pallas(q, k, v, *, g=None, g_gamma=None, scale, initial_state=None,
                            output_final_state=False, cu_seqlens=None):
    """Pallas (Triton lowering) chunked simple GLA; runs interpreted off-GPU.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in bf16/fp16/fp32.
        g: None or fp32 [B, T, H] raw log-decay; g_gamma: None or fp32 [H].
        scale: float. initial_state: None or fp32 [N, H, K, V].
        cu_seqlens: None or int [N+1] (B == 1), may be traced.
    Returns:
        o [B, T, H, V] in q's dtype; final state fp32 [N, H, K, V] or None.
    Differentiable (custom_vjp with Pallas backward kernels) w.r.t. q, k, v, g, initial_state.
    """
    st = make_static(q, v, g, g_gamma, initial_state, cu_seqlens, scale)
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    o, ht = scan_vjp(SCAN_KERNELS, st, q, k, v, g, g_gamma, initial_state, cu)
    return o, (ht if output_final_state else None)
