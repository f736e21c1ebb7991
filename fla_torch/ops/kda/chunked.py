"""Chunk-parallel Kimi Delta Attention in plain torch ops (autograd; the CPU path).

KDA is the DPLR recurrence of common/dplr_chunked.py with a_t = exp(g_t) * k_t,
b_t = -beta_t k_t and write key beta_t k_t:
    (I - beta k k^T) diag(exp(g)) S + beta k v^T = diag(exp(g)) S + b (a^T S) + (beta k) v^T.
"""
from __future__ import annotations

from ..common.dplr_chunked import dplr_chunked
from ..common.qk_inputs import prepare_qkv


def kda_chunked(q, k, v, g, beta, scale=1.0, initial_state=None, output_final_state=False,
                cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV] (HV % H == 0).

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 (fp64 for fp64 q)).
    """
    qf, kf, vf = prepare_qkv(q, k, v, use_qk_l2norm_in_kernel)
    cd = qf.dtype
    gf, bk = g.to(cd), beta.to(cd)[..., None] * kf
    o, final = dplr_chunked(qf, bk, vf, gf, gf.exp() * kf, -bk, scale, initial_state,
                            output_final_state, cu_seqlens)
    return o.to(q.dtype), final
