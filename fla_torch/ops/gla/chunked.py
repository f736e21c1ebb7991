"""Chunk-parallel GLA (per-channel gate) in plain torch ops (autograd; the CPU path).

Inside a chunk with entering state S0, write G(j, i) = g_{j+1} + ... + g_i in R^K:
    o_i   = scale * ( (q_i * exp(G(0, i))) S0 + sum_{j <= i} A_ij v_j ),
            A_ij = sum_k q_ik k_jk exp(G(j, i)_k)
    S_end = diag(exp(G(0, C))) S0 + sum_j (k_j * exp(G(j, C)))^T v_j
A needs the per-channel segment sums ([C, C, K] per chunk, masked before exp; see
common/causal_decay.py), so the chunk is small (16) to bound memory. Computes in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

from ..common.causal_decay import chunk_decays, vector_decay_scores
from ..common.chunk_packing import from_chunks, make_plan, scan_chunks, to_chunks
from ..common.qk_inputs import prepare_qkv

CHUNK_SIZE = 16


def gla_chunked(q, k, v, g, scale=1.0, initial_state=None, output_final_state=False,
                cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay.

    Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 (fp64 for fp64 q)).
    """
    qf, kf, vf = prepare_qkv(q, k, v)
    B, T, H, K = kf.shape
    V = vf.shape[-1]
    cd = qf.dtype
    plan = make_plan(B, T, cu_seqlens, chunk_size, device=q.device)
    qc, kc, vc = to_chunks(plan, qf), to_chunks(plan, kf), to_chunks(plan, vf)  # [R,H,NC,C,*]
    gc = to_chunks(plan, g.to(cd)).transpose(-1, -2)                    # [R,H,NC,K,C]
    D, to_start, to_end, chunk_decay = chunk_decays(gc)                  # D [R,H,NC,K,C,C]

    o_intra = vector_decay_scores(qc, kc, D) @ vc                        # [R,H,NC,C,V]
    q_in = qc * to_start.transpose(-1, -2)                               # [R,H,NC,C,K]
    k_out = kc * to_end.transpose(-1, -2)
    updates = (k_out.transpose(-1, -2) @ vc).unbind(2)                   # NC x [R,H,K,V]
    decays = chunk_decay.unbind(2)                                       # NC x [R,H,K]

    def step(c, S):
        return decays[c][..., None] * S + updates[c], None

    S_in, _, final = scan_chunks(plan, initial_state, (H, K, V), cd, q.device, step)
    o = scale * (q_in @ S_in + o_intra)
    o = from_chunks(plan, o).to(q.dtype)
    return o, (final if output_final_state else None)
