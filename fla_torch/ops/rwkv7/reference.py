"""Token-by-token RWKV-7 (the oracle; works in float64).

Per sequence and head, S: [K, V] starting at initial_state (or 0):
    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t S_{t-1}) + k_t^T v_t;   o_t = scale * r_t S_t
"""
from __future__ import annotations

import torch

from ..common.qk_inputs import prepare_qkv
from ..common.reference_loop import run_recurrence


def rwkv7_step(r_t, w_t, k_t, v_t, a_t, b_t, S, scale: float):
    """One token for all rows: r_t, w_t, k_t, a_t, b_t [R, H, K]; v_t [R, H, V];
    S [R, H, K, V]. Returns (o_t [R, H, V], S_t)."""
    sa = torch.einsum("rhk,rhkv->rhv", a_t, S)
    S = (w_t.exp()[..., :, None] * S + b_t[..., :, None] * sa[..., None, :]
         + k_t[..., :, None] * v_t[..., None, :])
    return scale * torch.einsum("rhk,rhkv->rhv", r_t, S), S


def rwkv7_reference(r, k, v, w, a, b, scale=1.0, initial_state=None, output_final_state=False,
                    cu_seqlens=None):
    """r, k, w, a, b: [B, T, H, K]; v: [B, T, H, V].

    Returns (o [B, T, H, V] in r's dtype, final_state [N, H, K, V] fp32 (fp64 for fp64 r)).
    """
    rf, kf, vf = prepare_qkv(r, k, v)
    H, K, V = kf.shape[2], kf.shape[3], vf.shape[3]
    cd = rf.dtype

    def step(x, S):
        r_t, w_t, k_t, v_t, a_t, b_t = x
        return rwkv7_step(r_t, w_t, k_t, v_t, a_t, b_t, S, scale)

    o, final = run_recurrence([rf, w.to(cd), kf, vf, a.to(cd), b.to(cd)], initial_state,
                              cu_seqlens, (H, K, V), V, step)
    return o.to(r.dtype), (final if output_final_state else None)
