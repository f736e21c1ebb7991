"""Chunk-parallel GLA (per-channel gate) in plain torch ops (autograd; the CPU path).

Inside a chunk with inclusive cumulative log-decay b_i in R^K and entering state S0:
    o_i   = scale * ( (q_i * exp(b_i)) S0 + sum_{j <= i} A_ij v_j ),
            A_ij = sum_k q_ik k_jk exp(b_ik - b_jk)
    S_end = diag(exp(b_C)) S0 + sum_j (k_j * exp(b_C - b_j))^T v_j
A is formed from masked per-channel gate differences ([C, C, K] per chunk), so the chunk
is small (16) to bound memory. Computes in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

from ..common.causal_decay import vector_decay_scores
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
    b = to_chunks(plan, g.to(cd)).cumsum(-2)                             # [R,H,NC,C,K]

    o_intra = vector_decay_scores(qc, kc, b) @ vc                        # [R,H,NC,C,V]
    q_in = qc * b.exp()
    k_out = kc * (b[..., -1:, :] - b).exp()
    updates = k_out.transpose(-1, -2) @ vc                               # [R,H,NC,K,V]
    chunk_decay = b[..., -1, :].exp()                                    # [R,H,NC,K]

    def step(c, S):
        return chunk_decay[:, :, c, :, None] * S + updates[:, :, c], None

    S_in, _, final = scan_chunks(plan, initial_state, (H, K, V), cd, q.device, step)
    o = scale * (q_in @ S_in + o_intra)
    o = from_chunks(plan, o).to(q.dtype)
    return o, (final if output_final_state else None)
