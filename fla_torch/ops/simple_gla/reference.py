"""Token-by-token simple GLA (the oracle; works in float64).

Per sequence and head, S: [K, V] starting at initial_state (or 0), g_t = g[t] + g_gamma:
    S_t = exp(g_t) S_{t-1} + k_t^T v_t
    o_t = scale * q_t S_t
"""
from __future__ import annotations

import torch

from ..common.qk_inputs import prepare_qkv
from ..common.reference_loop import run_recurrence


def simple_gla_reference(q, k, v, g=None, g_gamma=None, scale=1.0, initial_state=None,
                         output_final_state=False, cu_seqlens=None):
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None; g_gamma: [H] or None.

    Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 (fp64 for fp64 q)).
    """
    qf, kf, vf = prepare_qkv(q, k, v)
    B, T, HV, K = kf.shape
    V = vf.shape[-1]
    decay = None
    if g is not None:
        decay = g.to(qf.dtype)
    if g_gamma is not None:
        gamma = g_gamma.to(qf.dtype).expand(B, T, HV)
        decay = gamma if decay is None else decay + gamma

    def step(x, S):
        q_t, k_t, v_t, g_t = x
        if g_t is not None:
            S = g_t.exp()[..., None, None] * S
        S = S + k_t[..., :, None] * v_t[..., None, :]
        o_t = scale * torch.einsum("rhk,rhkv->rhv", q_t, S)
        return o_t, S

    o, final = run_recurrence([qf, kf, vf, decay], initial_state, cu_seqlens, (HV, K, V), V,
                              step)
    return o.to(q.dtype), (final if output_final_state else None)
