"""Token-by-token GLA with a per-channel gate (the oracle; works in float64).

Per sequence and head, S: [K, V] starting at initial_state (or 0), g_t in R^K:
    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t
    o_t = scale * q_t S_t
"""
from __future__ import annotations

import torch

from ..common.qk_inputs import prepare_qkv
from ..common.reference_loop import run_recurrence


def gla_reference(q, k, v, g, scale=1.0, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay.

    Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 (fp64 for fp64 q)).
    """
    qf, kf, vf = prepare_qkv(q, k, v)
    HV, K, V = kf.shape[2], kf.shape[3], vf.shape[3]

    def step(x, S):
        q_t, k_t, v_t, g_t = x
        S = g_t.exp()[..., :, None] * S + k_t[..., :, None] * v_t[..., None, :]
        o_t = scale * torch.einsum("rhk,rhkv->rhv", q_t, S)
        return o_t, S

    o, final = run_recurrence([qf, kf, vf, g.to(qf.dtype)], initial_state, cu_seqlens,
                              (HV, K, V), V, step)
    return o.to(q.dtype), (final if output_final_state else None)
