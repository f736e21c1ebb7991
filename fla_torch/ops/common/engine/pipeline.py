"""The engine's stages in order, forward and backward, for a gated chunked recurrence (Triton).

Forward: chunk_cumsum (the split in-chunk gate cumsum and k exp(last - b), once) and
intra_scores (A and q exp(b), once per chunk and head), or for the key gate both in one kernel
(cumsum_scores), then state_pass_fwd (h, the state before every chunk, and the final state),
output_fwd. Backward: state_pass_bwd (dh, dh0), output_bwd (dv and dA, then the intra-chunk
dq / dk, then dq, dk, dg). h, dh are kept in q's dtype (tensor-core operands; fp32 for fp32).
"""
from __future__ import annotations

from .cumsum_scores import cumsum_scores
from .gates import GATE_KEY, chunk_cumsum
from .launch import launch_for
from .output_grads import output_bwd
from .output_stage import output_fwd
from .scores import intra_scores
from .state_pass import state_pass_bwd, state_pass_fwd


def chunk_forward(q, k, v, g, gate: int, scale: float, initial_state, output_final_state: bool,
                  cu_seqlens, prec: str, alloc, need_backward: bool = True):
    """q, k [B, T, H, K], v [B, T, H, V], g per `gate` (fp32 or None).
    Returns (o, final state or None, saved: the tensors chunk_backward needs; with
    need_backward=False the key gate's split cumsum is not stored and saved holds None for it)."""
    if gate == GATE_KEY.value:
        cum, kg, el, A, qg = cumsum_scores(q, k, g, cu_seqlens, prec, alloc,
                                           store_cum=need_backward)
    else:
        cfg = launch_for("cumsum", q.shape[3], v.shape[3], q.dtype)
        cum, kg, el = chunk_cumsum(g, k, gate, cu_seqlens, cfg.BT, cfg.BK, alloc)
        A, qg = intra_scores(q, k, cum, gate, cu_seqlens, prec, alloc)
    h, ht = state_pass_fwd(kg, v, el, gate, initial_state, output_final_state, cu_seqlens,
                           q.dtype, prec, alloc)
    o = output_fwd(qg, v, h, A, scale, cu_seqlens, prec, alloc)
    saved = (cum[0], cum[1]) if cum is not None else (None, None)
    return o, ht, saved + (kg, h, A)


def chunk_backward(q, k, v, saved, do, dht, gate: int, scale: float, cu_seqlens, need_dh0: bool,
                   need_dg: bool, prec: str, alloc):
    """(dq, dk, dv, dg or None, dh0 or None) from chunk_forward's `saved`, do [B, T, H, V] and
    dht [N, H, K, V] fp32 or None."""
    ch, cl, kg, h, A = saved
    cum = (ch, cl) if ch is not None else None
    dh, dh0 = state_pass_bwd(q, do, cum, gate, scale, dht, cu_seqlens, need_dh0, q.dtype, prec,
                             alloc)
    dq, dk, dv, dg = output_bwd(q, k, v, kg, cum, gate, A, h, dh, do, scale, cu_seqlens,
                                need_dg, prec, alloc)
    return dq, dk, dv, dg, dh0
