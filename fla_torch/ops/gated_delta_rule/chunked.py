"""Chunk-parallel gated delta rule (WY / UT transform) in plain torch ops (autograd).

Inside a chunk of C tokens with entering state S0, write G(j, i) = g_{j+1} + ... + g_i
(G = 0 for the plain delta rule) and b_i = G(0, i). The per-token "new values"
u'_t = beta_t (v_t - exp(g_t) k_t S_{t-1}) solve the unit lower-triangular system
    (I + L) U' = diag(beta) V - diag(beta exp(b)) K S0,
    L_ij = beta_i (k_i . k_j) exp(G(j, i)) for j < i, 0 otherwise,
so with T = (I + L)^-1 (one triangular solve per chunk):
    u = T diag(beta) V,   w = T diag(beta exp(b)) K,   U' = u - w S0
    o_i   = scale * ( exp(b_i) q_i S0 + sum_{j <= i} exp(G(j, i)) (q_i . k_j) u'_j )
    S_end = exp(b_C) S0 + sum_j exp(G(j, C)) k_j^T u'_j
Only U' and the states are sequential across chunks. Every exponent is a segment sum <= 0,
masked before exp (see common/causal_decay.py). Computes in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

import torch

from ..common.causal_decay import causal_ones, chunk_decays
from ..common.chunk_packing import from_chunks, make_plan, scan_chunks, to_chunks
from ..common.qk_inputs import prepare_qkv

CHUNK_SIZE = 64


def delta_chunked(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                  use_qk_l2norm_in_kernel, chunk_size=CHUNK_SIZE):
    """Shared body of delta_rule_chunked (g=None) and gated_delta_rule_chunked.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g (or None), beta: [B, T, HV].
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32/fp64 or None).
    """
    qf, kf, vf = prepare_qkv(q, k, v, use_qk_l2norm_in_kernel)
    B, T, HV, K = kf.shape
    V = vf.shape[-1]
    cd = qf.dtype
    C = chunk_size
    plan = make_plan(B, T, cu_seqlens, C, device=q.device)
    qc, kc, vc = to_chunks(plan, qf), to_chunks(plan, kf), to_chunks(plan, vf)  # [R,HV,NC,C,*]
    bc = to_chunks(plan, beta.to(cd))                                    # [R,HV,NC,C]

    if g is None:
        incl = causal_ones(C, cd, q.device)
        strict = causal_ones(C, cd, q.device, strict=True)
        q_in, k_out, w_key, chunk_decay = qc, kc, kc, None
    else:
        incl, to_start, to_end, chunk_decay = chunk_decays(to_chunks(plan, g.to(cd)))
        strict = incl * causal_ones(C, cd, q.device, strict=True)       # [R,HV,NC,C,C]
        q_in = qc * to_start[..., None]
        k_out = kc * to_end[..., None]
        w_key = kc * to_start[..., None]

    eye = torch.eye(C, dtype=cd, device=q.device)
    lower = bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * strict     # [R,HV,NC,C,C]
    rhs = torch.cat([bc[..., None] * vc, bc[..., None] * w_key], dim=-1)  # [R,HV,NC,C,V+K]
    solved = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :V], solved[..., V:]
    scores = (qc @ kc.transpose(-1, -2)) * incl                          # [R,HV,NC,C,C]

    # per-chunk views for the sequential part (unbind: one gradient stack, not one per chunk)
    us, ws, k_outs_t = u.unbind(2), w.unbind(2), k_out.transpose(-1, -2).unbind(2)
    decays = None if chunk_decay is None else chunk_decay.unbind(2)      # NC x [R,HV]

    def step(c, S):
        v_new = us[c] - ws[c] @ S                                        # [R,HV,C,V]
        if decays is not None:
            S = decays[c][..., None, None] * S
        return S + k_outs_t[c] @ v_new, v_new

    S_in, v_news, final = scan_chunks(plan, initial_state, (HV, K, V), cd, q.device, step)
    v_new = torch.stack(v_news, dim=2)                                   # [R,HV,NC,C,V]
    o = scale * (q_in @ S_in + scores @ v_new)
    o = from_chunks(plan, o).to(q.dtype)
    return o, (final if output_final_state else None)


def gated_delta_rule_chunked(q, k, v, g, beta, scale=1.0, initial_state=None,
                             output_final_state=False, cu_seqlens=None,
                             use_qk_l2norm_in_kernel=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] (HV % H == 0).

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 (fp64 for fp64 q)).
    """
    return delta_chunked(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                         use_qk_l2norm_in_kernel)
