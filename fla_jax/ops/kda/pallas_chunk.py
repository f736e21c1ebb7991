"""chunk_kda on the Pallas DPLR chunk pipeline (common/engine/dplr.py), forward and
backward; runs interpreted off-GPU.

KDA is the DPLR recurrence with a = exp(g) k, b = -beta k and write key beta k (formed in
fp32 with jnp; autodiff carries dg, dbeta through them). Grouped heads: q and k are repeated
to the HV value heads (their gradients summed back by autodiff).
use_qk_l2norm_in_kernel: q, k l2-normalised in fp32 first (outside the kernels).
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.compute_operands import expand_heads, l2_normalize
from ..common.engine.dplr import dplr_chunk

F32 = jnp.float32


def chunk_kda_pallas(q, k, v, *, g, beta, scale, initial_state, output_final_state,
                     cu_seqlens, use_qk_l2norm_in_kernel=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0), one dtype in bf16/fp16/fp32
    (K, V <= 256); g: [B, T, HV, K] fp32; beta: [B, T, HV] fp32; initial_state: None or
    [N, HV, K, V] fp32; cu_seqlens: None or [N+1] int (B == 1, may be traced).
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None).
    Differentiable w.r.t. q, k, v, g, beta, initial_state."""
    qf, kf = q.astype(F32), k.astype(F32)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2_normalize(qf), l2_normalize(kf)
    HV = v.shape[2]
    qf, kf = expand_heads(qf, HV), expand_heads(kf, HV)
    g = g.astype(F32)
    bk = beta.astype(F32)[..., None] * kf
    o, ht = dplr_chunk(qf, bk, v, g, jnp.exp(g) * kf, -bk, float(scale), initial_state,
                       output_final_state, cu_seqlens)
    return o.astype(q.dtype), ht
