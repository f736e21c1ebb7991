"""Chunk-parallel simple GLA in plain torch ops (differentiable by autograd; the CPU path).

Inside a chunk of C tokens with entering state S0, write G(j, i) = g_{j+1} + ... + g_i:
    o_i   = scale * ( exp(G(0, i)) q_i S0 + sum_{j <= i} exp(G(j, i)) (q_i . k_j) v_j )
    S_end = exp(G(0, C)) S0 + sum_j exp(G(j, C)) k_j^T v_j
Every exponent is a segment sum <= 0, masked before exp (see common/causal_decay.py), so
strong gates underflow to 0 instead of overflowing and the gate gradient does not cancel. Computes in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

from ..common.causal_decay import causal_ones, chunk_decays
from ..common.chunk_packing import from_chunks, make_plan, scan_chunks, to_chunks
from ..common.qk_inputs import prepare_qkv

CHUNK_SIZE = 64


def simple_gla_chunked(q, k, v, g=None, g_gamma=None, scale=1.0, initial_state=None,
                       output_final_state=False, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None; g_gamma: [H] or None.

    Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 (fp64 for fp64 q)).
    """
    qf, kf, vf = prepare_qkv(q, k, v)
    B, T, H, K = kf.shape
    V = vf.shape[-1]
    cd = qf.dtype
    plan = make_plan(B, T, cu_seqlens, chunk_size, device=q.device)
    qc, kc, vc = to_chunks(plan, qf), to_chunks(plan, kf), to_chunks(plan, vf)  # [R,H,NC,C,*]

    logd = None
    if g is not None:
        logd = g.to(cd)
    if g_gamma is not None:
        gamma = g_gamma.to(cd).expand(B, T, H)
        logd = gamma if logd is None else logd + gamma
    scores = qc @ kc.transpose(-1, -2)                                  # [R,H,NC,C,C]
    if logd is None:
        scores = scores * causal_ones(chunk_size, cd, q.device)
        q_in, k_out, chunk_decay = qc, kc, None
    else:
        D, to_start, to_end, chunk_decay = chunk_decays(to_chunks(plan, logd))  # [R,H,NC,C(,C)]
        scores = scores * D
        q_in = qc * to_start[..., None]
        k_out = kc * to_end[..., None]
    o_intra = scores @ vc                                                # [R,H,NC,C,V]
    updates = (k_out.transpose(-1, -2) @ vc).unbind(2)                   # NC x [R,H,K,V]
    decays = None if chunk_decay is None else chunk_decay.unbind(2)      # NC x [R,H]

    def step(c, S):
        if decays is not None:
            S = decays[c][..., None, None] * S
        return S + updates[c], None

    S_in, _, final = scan_chunks(plan, initial_state, (H, K, V), cd, q.device, step)
    o = scale * (q_in @ S_in + o_intra)
    o = from_chunks(plan, o).to(q.dtype)
    return o, (final if output_final_state else None)
