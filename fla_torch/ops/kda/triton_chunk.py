"""chunk_kda on the Triton DPLR chunk pipeline (common/engine/dplr.py), forward and backward.

KDA is the DPLR recurrence with a = exp(g) k, b = -beta k and write key beta k (formed in
fp32 with torch ops; autograd carries dg, dbeta through them). Grouped heads: q and k are
repeated to the HV value heads (their gradients summed back by autograd).
use_qk_l2norm_in_kernel: q, k l2-normalised in fp32 (common/l2norm.py) first.
"""
from __future__ import annotations

from ..common.engine.dplr import dplr_chunk
from ..common.l2norm import l2norm
from ..common.qk_inputs import expand_heads


def chunk_kda_triton(q, k, v, *, g, beta, scale, initial_state, output_final_state,
                     cu_seqlens, use_qk_l2norm_in_kernel):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0), one dtype in bf16/fp16/fp32;
    g: [B, T, HV, K] fp32; beta: [B, T, HV] fp32; initial_state: None or [N, HV, K, V] fp32;
    cu_seqlens: None or [N+1] int (B == 1). Returns (o [B, T, HV, V] in q's dtype,
    final_state [N, HV, K, V] fp32 or None)."""
    dt = q.dtype
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    HV = v.shape[2]
    qf, kf = expand_heads(qf, HV), expand_heads(kf, HV)
    bk = beta[..., None] * kf
    o, ht = dplr_chunk(qf, bk, v.float(), g, g.exp() * kf, -bk, float(scale), initial_state,
                       output_final_state, cu_seqlens)
    return o.to(dt), ht
