"""Chunk-parallel diagonal-plus-low-rank (DPLR) recurrence in plain torch ops (autograd).

Per sequence and head, S: [K, V]:
    S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = scale * r_t S_t
(RWKV-7; KDA is the case a = exp(g) k, b = -beta k, write key beta k.)

Inside a chunk of C tokens entering with S0, with D(j, i) = exp(w_{j+1} + ... + w_i) per key
(masked segment sums, every exponent <= 0; see common/causal_decay.py) and u_t = a_t^T S_{t-1}
(the low-rank read, [V]):
    U = A_ab U + A_ak V + A~ S0      A_ab[i, j] = sum_k a_ik b_jk D(j, i-1)_k  (j < i)
                                     A_ak likewise with k_j, A~_i = a_i * D(0, i-1)
so with T = (I - A_ab)^-1 (one unit lower-triangular solve per chunk):
    u = T A_ak V,  w = T A~,  U = u + w S0              (only U and S are sequential)
    o_i   = scale * ( (r_i * D(0, i)) S0 + sum_{j <= i} (A_rb[i, j] U_j + A_rk[i, j] v_j) )
    S_end = diag(D(0, C)) S0 + sum_j D(j, C) * (b_j U_j^T + k_j v_j^T)
A_rb, A_rk use D(j, i) (j <= i). The per-key decays are [K, C, C] per chunk, so C is small.
Computes in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

import torch

from .causal_decay import chunk_decays, vector_decay_scores
from .chunk_packing import from_chunks, make_plan, scan_chunks, to_chunks

CHUNK_SIZE = 16


def dplr_chunked(r, k, v, w, a, b, scale, initial_state, output_final_state, cu_seqlens,
                 chunk_size=CHUNK_SIZE):
    """r, k, w, a, b: [B, T, H, K]; v: [B, T, H, V], all in one compute dtype (fp32 / fp64).

    Returns (o [B, T, H, V] in the compute dtype, final_state [N, H, K, V] or None).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    cd = r.dtype
    C = chunk_size
    plan = make_plan(B, T, cu_seqlens, C, device=r.device)
    rc, kc, vc, ac, bc = (to_chunks(plan, x) for x in (r, k, v, a, b))  # [R,H,NC,C,*]
    wc = to_chunks(plan, w).transpose(-1, -2)                            # [R,H,NC,K,C]
    D, to_start, to_end, total = chunk_decays(wc)                        # D [R,H,NC,K,C,C]
    # D(j, i-1) for j < i: row i of D_excl is row i-1 of D (row 0 empty)
    D_excl = torch.cat([torch.zeros_like(D[..., :1, :]), D[..., :-1, :]], dim=-2)
    start_excl = torch.cat([torch.ones_like(to_start[..., :1]), to_start[..., :-1]], dim=-1)

    A_ab = vector_decay_scores(ac, bc, D_excl)                           # [R,H,NC,C,C]
    A_ak = vector_decay_scores(ac, kc, D_excl)
    A_rb = vector_decay_scores(rc, bc, D)
    A_rk = vector_decay_scores(rc, kc, D)
    a_in = ac * start_excl.transpose(-1, -2)                             # [R,H,NC,C,K]
    r_in = rc * to_start.transpose(-1, -2)
    b_out = bc * to_end.transpose(-1, -2)
    k_out = kc * to_end.transpose(-1, -2)

    eye = torch.eye(C, dtype=cd, device=r.device)
    rhs = torch.cat([A_ak @ vc, a_in], dim=-1)                           # [R,H,NC,C,V+K]
    solved = torch.linalg.solve_triangular(eye - A_ab, rhs, upper=False, unitriangular=True)
    us, ws = solved[..., :V].unbind(2), solved[..., V:].unbind(2)
    b_outs_t = b_out.transpose(-1, -2).unbind(2)                         # NC x [R,H,K,C]
    updates = (k_out.transpose(-1, -2) @ vc).unbind(2)                   # NC x [R,H,K,V]
    decays = total.unbind(2)                                             # NC x [R,H,K]

    def step(c, S):
        U = us[c] + ws[c] @ S                                            # [R,H,C,V]
        return decays[c][..., None] * S + b_outs_t[c] @ U + updates[c], U

    S_in, Us, final = scan_chunks(plan, initial_state, (H, K, V), cd, r.device, step)
    U = torch.stack(Us, dim=2)                                           # [R,H,NC,C,V]
    o = scale * (r_in @ S_in + A_rb @ U + A_rk @ vc)
    return from_chunks(plan, o), (final if output_final_state else None)
