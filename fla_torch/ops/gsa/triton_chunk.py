"""Chunked Gated Slot Attention in Triton on the chunk engine (fla_torch/ops/common/engine).

GSA is two gated passes with a softmax between them (gsa/interface.py). The value pass is GLA
(q = softmax(ok), k = s, v, per-key gate g, scale 1): the engine's forward and backward as
GLA runs them. The slot pass has its gate on the value (slot) side; it is the adjoint of a GLA
problem F with keys s, values k and key gate g, whose states are hk^T [M, K]:
    ok = dQ of F for the cotangent do = q      (F's output gradient w.r.t. its queries)
so its forward is F's state pass plus the engine's output backward, and its backward is F run
forward and backward with queries dok and cotangent q:
    dq = o of F(Q = dok);  (ds, dk, dg, dhk0^T) = (dK, dV, dg, dh0) of F's backward.
No new kernel and no new gate switch: the engine's GATE_KEY stages with M as their key size.
"""
from __future__ import annotations

import torch

from ..common.engine import (GATE_KEY, chunk_backward, chunk_cumsum, chunk_forward,
                             intra_scores, launch_for, n_slots, output_bwd, output_fwd,
                             state_pass_bwd, state_pass_fwd)
from ..common.kernel_alloc import alloc_on, contiguous as _contig
from ..common.triton_scalar_gate import dot_precision
from .slot_inputs import kernel_call, transposed as _t

_GATE = GATE_KEY.value


def _slot_pass_fwd(q, k, s, g, scale, hk0t, output_final_state, cu_seqlens, prec, alloc):
    """(ok [B, T, H, M] in q's dtype, final hk^T [N, H, M, K] fp32 or None, saved)."""
    B, T, H, M = s.shape
    cfg = launch_for("cumsum", M, k.shape[3], s.dtype)
    cum, kg, el = chunk_cumsum(g, s, _GATE, cu_seqlens, cfg.BT, cfg.BK, alloc)
    h, hkt = state_pass_fwd(kg, k, el, _GATE, hk0t, output_final_state, cu_seqlens, s.dtype,
                            prec, alloc)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = n_slots(B, T, N, cfg.BT, cu_seqlens is not None)
    no_A = torch.zeros((S * cfg.BT, H, cfg.BT), dtype=torch.float32, device=q.device)
    ok, _, _, _ = output_bwd(s, s, k, kg, cum, _GATE, no_A, h, torch.zeros_like(h), q, scale,
                             cu_seqlens, False, prec, alloc)
    return ok, hkt, (cum[0], cum[1], kg, h)


def _slot_pass_bwd(q, k, s, saved, dok, dhkt_t, scale, cu_seqlens, need_dh0, prec, alloc):
    """(dq, dk, ds, dg, dhk0^T) of the slot pass (F's forward output and backward)."""
    ch, cl, kg, h = saved
    cum = (ch, cl)
    A, qg = intra_scores(dok, s, cum, _GATE, cu_seqlens, prec, alloc)
    dq = output_fwd(qg, k, h, A, scale, cu_seqlens, prec, alloc)
    dh, dhk0t = state_pass_bwd(dok, q, cum, _GATE, scale, dhkt_t, cu_seqlens, need_dh0,
                               s.dtype, prec, alloc)
    _, ds, dk, dg = output_bwd(dok, s, k, kg, cum, _GATE, A, h, dh, q, scale, cu_seqlens, True,
                               prec, alloc)
    return dq, dk, ds, dg, dhk0t


class _ChunkGSA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens):
        prec = dot_precision(q.dtype)
        alloc = alloc_on(q.device)
        ok, hkt_t, saved1 = _slot_pass_fwd(q, k, s, g, scale, _t(hk0), output_final_state,
                                           cu_seqlens, prec, alloc)
        p32 = torch.softmax(ok.float(), dim=-1)
        p = p32.to(q.dtype)
        o, hvt, saved2 = chunk_forward(p, s, v, g, _GATE, 1.0, hv0, output_final_state,
                                       cu_seqlens, prec, alloc)
        ctx.save_for_backward(q, k, v, s, p32, p, cu_seqlens, *saved1, *saved2)
        ctx.scale, ctx.prec = scale, prec
        ctx.has_hk0, ctx.has_hv0 = hk0 is not None, hv0 is not None
        return o, _t(hkt_t), hvt

    @staticmethod
    def backward(ctx, do, dhkt, dhvt):
        q, k, v, s, p32, p, cu_seqlens, *saved = ctx.saved_tensors
        saved1, saved2 = saved[:4], saved[4:]
        alloc = alloc_on(q.device)
        dp, ds2, dv, dg2, dhv0 = chunk_backward(
            p, s, v, saved2, do.contiguous(), _contig(dhvt), _GATE, 1.0, cu_seqlens,
            ctx.has_hv0, True, ctx.prec, alloc)
        dp = dp.float()
        dok = (p32 * (dp - (p32 * dp).sum(-1, keepdim=True))).to(q.dtype)
        dq, dk, ds1, dg1, dhk0t = _slot_pass_bwd(
            q, k, s, saved1, dok, _t(dhkt), ctx.scale, cu_seqlens, ctx.has_hk0, ctx.prec, alloc)
        ds = (ds1.float() + ds2.float()).to(s.dtype)
        return dq, dk, dv, ds, dg1 + dg2, None, _t(dhk0t), dhv0, None, None


def chunk_gsa_triton(q, k, v, s, *, g=None, scale=1.0, initial_state=None,
                     output_final_state=False, cu_seqlens=None):
    """Chunked GSA (Triton). q [B, T, HQ, K]; k [B, T, H, K]; v [B, T, H, V]; s [B, T, H, M]
    (bf16/fp16/fp32, one dtype); g [B, T, H, M] fp32 log-decay or None (FLA's additive gate
    from s, formed in fp32 and its weights rounded to q's dtype); initial_state None or
    (hk0 [N, H, K, M] | None, hv0 [N, H, M, V] | None) fp32; cu_seqlens [N+1] int or None
    (B == 1). Returns (o [B, T, HQ, V] in q's dtype, (hk, hv) fp32 or None)."""
    return kernel_call(_ChunkGSA.apply, q, k, v, s, g, scale, initial_state, output_final_state,
                       cu_seqlens)
