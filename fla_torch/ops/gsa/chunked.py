"""Chunk-parallel Gated Slot Attention in plain torch ops (autograd; the CPU path).

The slot pass has its decay on the value (slot) side. Inside a chunk with entering state
hk0 and G(j, i) = g_{j+1} + ... + g_i in R^M:
    ok_i  = scale * ( (q_i hk0) * exp(G(0, i)) + sum_{j <= i} (q_i . k_j) s_j * exp(G(j, i)) )
    hk_end = hk0 diag(exp(G(0, C))) + sum_j k_j^T (s_j * exp(G(j, C)))
The value pass (q = softmax(ok), k = s, v, key-side gate g, scale 1) is chunked GLA.
Computes in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

import torch

from ..common.causal_decay import chunk_decays
from ..common.chunk_packing import from_chunks, make_plan, scan_chunks, to_chunks
from ..gla.chunked import gla_chunked
from .slot_inputs import group_final, gsa_operands

CHUNK_SIZE = 16


def slot_pass_chunked(q, k, s, g, scale, hk0, cu_seqlens, chunk_size=CHUNK_SIZE):
    """q, k: [B, T, H, K]; s, g: [B, T, H, M] (one compute dtype); hk0: None or [N, H, K, M].
    Returns (ok [B, T, H, M], hk [N, H, K, M])."""
    B, T, H, K = k.shape
    M = s.shape[-1]
    plan = make_plan(B, T, cu_seqlens, chunk_size, device=q.device)
    qc, kc, sc = to_chunks(plan, q), to_chunks(plan, k), to_chunks(plan, s)  # [R,H,NC,C,*]
    gc = to_chunks(plan, g).transpose(-1, -2)                              # [R,H,NC,M,C]
    D, to_start, to_end, chunk_decay = chunk_decays(gc)                    # D [R,H,NC,M,C,C]

    A = qc @ kc.transpose(-1, -2)                                          # [R,H,NC,C,C]
    o_intra = torch.einsum("rhnij,rhnmij,rhnjm->rhnim", A, D, sc)
    updates = (kc.transpose(-1, -2) @ (sc * to_end.transpose(-1, -2))).unbind(2)  # [R,H,K,M]
    decays = chunk_decay.unbind(2)                                         # NC x [R,H,M]

    def step(c, S):
        return S * decays[c][..., None, :] + updates[c], None

    S_in, _, final = scan_chunks(plan, hk0, (H, K, M), q.dtype, q.device, step)
    ok = scale * ((qc @ S_in) * to_start.transpose(-1, -2) + o_intra)
    return from_chunks(plan, ok), final


def gsa_chunked(q, k, v, s, g=None, scale=1.0, initial_state=None, output_final_state=False,
                cu_seqlens=None):
    """Same arguments and returns as gsa.reference.gsa_reference."""
    qf, kf, vf, sf, gf, hk0, hv0, NG = gsa_operands(q, k, v, s, g, initial_state, cu_seqlens)
    ok, hk = slot_pass_chunked(qf, kf, sf, gf, scale, hk0, cu_seqlens)
    o, hv = gla_chunked(ok.softmax(-1), sf, vf, gf, scale=1.0, initial_state=hv0,
                        output_final_state=True, cu_seqlens=cu_seqlens)
    final = (group_final(hk, NG), group_final(hv, NG)) if output_final_state else None
    return o.to(q.dtype), final
