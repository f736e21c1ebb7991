"""Token-by-token Kimi Delta Attention (the oracle; works in float64).

Per sequence and value head hv (reading q/k head hv // (HV // H)), S: [K, V] starting at
initial_state (or 0):
    S' = diag(exp(g_t)) S_{t-1};  S_t = S' + k_t^T (beta_t (v_t - k_t S'));  o_t = scale q_t S_t
With use_qk_l2norm_in_kernel, q and k are first l2-normalised over K in fp32 (fp64 for fp64).
"""
from __future__ import annotations

import torch

from ..common.qk_inputs import prepare_qkv
from ..common.reference_loop import run_recurrence


def kda_step(q_t, k_t, v_t, g_t, beta_t, S, scale: float):
    """One token for all rows: q_t, k_t, g_t [R, HV, K]; v_t [R, HV, V]; beta_t [R, HV];
    S [R, HV, K, V]. Returns (o_t [R, HV, V], S_t)."""
    S = g_t.exp()[..., :, None] * S
    v_new = beta_t[..., None] * (v_t - torch.einsum("rhk,rhkv->rhv", k_t, S))
    S = S + k_t[..., :, None] * v_new[..., None, :]
    return scale * torch.einsum("rhk,rhkv->rhv", q_t, S), S


def kda_reference(q, k, v, g, beta, scale=1.0, initial_state=None, output_final_state=False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV] (HV % H == 0).

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 (fp64 for fp64 q)).
    """
    qf, kf, vf = prepare_qkv(q, k, v, use_qk_l2norm_in_kernel)
    HV, K, V = kf.shape[2], kf.shape[3], vf.shape[3]

    def step(x, S):
        q_t, k_t, v_t, g_t, b_t = x
        return kda_step(q_t, k_t, v_t, g_t, b_t, S, scale)

    o, final = run_recurrence([qf, kf, vf, g.to(qf.dtype), beta.to(qf.dtype)], initial_state,
                              cu_seqlens, (HV, K, V), V, step)
    return o.to(q.dtype), (final if output_final_state else None)
