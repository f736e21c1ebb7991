"""Token-by-token Gated Slot Attention (the oracle; works in float64).

Per sequence and query head (hk: [K, M], hv: [M, V], starting at initial_state or 0):
    hk_t = hk_{t-1} diag(exp(g_t)) + k_t^T s_t ;  ok_t = scale * q_t hk_t
    p_t  = softmax(ok_t)
    hv_t = diag(exp(g_t)) hv_{t-1} + s_t^T v_t ;  o_t  = p_t hv_t
"""
from __future__ import annotations

import torch

from ..common.reference_loop import run_recurrence
from .slot_inputs import group_final, gsa_operands


def gsa_reference(q, k, v, s, g=None, scale=1.0, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    """q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]; s, g: [B, T, H, M] (g None: FLA's
    additive gate from s). initial_state: None or (hk0 [N, H, K, M] | None,
    hv0 [N, H, M, V] | None).

    Returns (o [B, T, HQ, V] in q's dtype, (hk [N, H, K, M], hv [N, H, M, V]) fp32 (fp64 for
    fp64 q) or None)."""
    qf, kf, vf, sf, gf, hk0, hv0, NG = gsa_operands(q, k, v, s, g, initial_state, cu_seqlens)
    HQ, K, V, M = qf.shape[2], qf.shape[3], vf.shape[3], sf.shape[3]

    def slot_step(x, S):
        q_t, k_t, s_t, g_t = x
        S = S * g_t.exp()[..., None, :] + k_t[..., :, None] * s_t[..., None, :]
        return scale * torch.einsum("rhk,rhkm->rhm", q_t, S), S

    def value_step(x, S):
        p_t, s_t, v_t, g_t = x
        S = g_t.exp()[..., :, None] * S + s_t[..., :, None] * v_t[..., None, :]
        return torch.einsum("rhm,rhmv->rhv", p_t, S), S

    ok, hk = run_recurrence([qf, kf, sf, gf], hk0, cu_seqlens, (HQ, K, M), M, slot_step)
    o, hv = run_recurrence([ok.softmax(-1), sf, vf, gf], hv0, cu_seqlens, (HQ, M, V), V,
                           value_step)
    final = (group_final(hk, NG), group_final(hv, NG)) if output_final_state else None
    return o.to(q.dtype), final
