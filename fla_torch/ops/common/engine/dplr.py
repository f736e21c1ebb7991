"""The DPLR chunk pipeline (Triton kernels), forward and backward (one autograd.Function).

    S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = scale * r_t S_t
(RWKV-7; KDA is a = exp(g) k, b = -beta k, write key beta k.) The chunk form is the one of
common/dplr_chunked.py with chunks of BT = 64, one slot per chunk (engine/varlen.py's slots: no
host synchronisation for cu_seqlens); `tok` maps every slot row to its token (-1: pad row).
Forward:
 1. dplr_scores.scores_fwd: reads r, k, a, b, w in the token layout; the per-key-decay scores
    A_ab, A_ak, A_rb, A_rk and the decayed vectors r_in, a_in, b_out, k_out, tot (fp32 slot
    layout; fp64 gate cumsum; diagonal sub-blocks by one fp32-accurate dot under gates.SPAN);
 2. dplr_wy.wy_fwd: T = (I - A_ab)^-1 (16x16 block inversion), u = T A_ak v, w = T a_in;
 3. dplr_state.state_fwd: U = u + w S_in and the state S_in entering every chunk (sequential);
 4. dplr_output.output_fwd: o = scale (r_in S_in + A_rb U + A_rk v), written to the token
    layout in r's dtype.
Backward: output_bwd, state_bwd (sequential), dplr_tail.tail_bwd (the state pass's chunk
products and the WY backward; dv to the token layout), scores_bwd (dr, dk, da, db, dw to the
token layout; it reads the forward's fp64 in-chunk cumsum, kept). No input is copied: every kernel reads r, k, v, w, a, b in the token layout.
Every dot on fp32 operands is fp32-accurate (tf32x3) unless allow_tf32() is active.
"""
from __future__ import annotations

import torch

from .dplr_output import output_bwd, output_fwd
from .dplr_scores import scores_fwd
from .dplr_scores_bwd import scores_bwd
from .dplr_state import state_bwd, state_fwd
from .dplr_tail import tail_bwd
from .dplr_wy import wy_fwd
from .varlen import n_slots

BT = 64


def slot_rows(B: int, T: int, cu_seqlens, device):
    """(row [B*T] int64: the slot-layout row of every token, first [N], count [N] int32,
    slots S). Computed on the device (no host synchronisation)."""
    if cu_seqlens is None:
        NT = -(-T // BT)
        tok = torch.arange(T, device=device)
        row = (torch.arange(B, device=device)[:, None] * (NT * BT) + tok[None, :]).reshape(-1)
        first = torch.arange(B, device=device, dtype=torch.int32) * NT
        count = torch.full((B,), NT, dtype=torch.int32, device=device)
        return row, first, count, B * NT
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    N = cu.shape[0] - 1
    tok = torch.arange(T, device=device)
    n = torch.searchsorted(cu, tok, right=True) - 1
    bos = cu[n]
    row = (bos // BT + n) * BT + (tok - bos)
    seq = torch.arange(N, device=device)
    first = (cu[:-1] // BT + seq).to(torch.int32)
    count = ((cu[1:] - cu[:-1] + BT - 1) // BT).to(torch.int32)
    return row, first, count, n_slots(1, T, N, BT, True)


class _DplrChunk(torch.autograd.Function):

    @staticmethod
    def forward(ctx, r, k, v, w, a, b, h0, scale, output_final_state, cu_seqlens):
        B, T = r.shape[0], r.shape[1]
        row, first, count, S = slot_rows(B, T, cu_seqlens, r.device)
        varlen = cu_seqlens is not None
        tok = torch.full((S * BT,), -1, dtype=torch.int64, device=r.device)
        tok[row] = torch.arange(B * T, device=r.device)
        A_ab, A_ak, A_rb, A_rk, r_in, a_in, b_out, k_out, tot, G = scores_fwd(r, k, a, b, w, tok)
        Tm, u, wy = wy_fwd(A_ab, A_ak, v, tok, a_in)
        U, S_in, ht = state_fwd(u, wy, b_out, k_out, v, tok, tot, h0, first, count,
                                output_final_state, varlen)
        o = output_fwd(r_in, S_in, A_rb, U, A_rk, v, tok, scale, B, T, r.dtype)
        ctx.save_for_backward(r, k, v, w, a, b, tok, first, count, A_ak, A_rb, A_rk, r_in,
                              b_out, k_out, tot, Tm, u, wy, U, S_in, G)
        ctx.scale, ctx.varlen, ctx.has_h0 = scale, varlen, h0 is not None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        (r, k, v, w, a, b, tok, first, count, A_ak, A_rb, A_rk, r_in, b_out, k_out, tot,
         Tm, u, wy, U, S_in, G) = ctx.saved_tensors
        dr_in, dS_in, dA_rb, dU, dA_rk, dv_o = output_bwd(r_in, S_in, A_rb, U, A_rk, v, tok,
                                                          ctx.scale, do.contiguous())
        du, dh, dh0 = state_bwd(wy, b_out, tot, dU, dS_in,
                                None if dht is None else dht.contiguous(), first, count,
                                ctx.has_h0, ctx.varlen)
        dA_ab, dA_ak, da_in, db_out, dk_out, dtot, dv = tail_bwd(Tm, A_ak, u, wy, U, S_in, v,
                                                                k_out, du, dh, dv_o, tok)
        dr, dk, da, db, dw = scores_bwd(r, k, a, b, w, tok, G, [dA_ab, dA_ak, dA_rb, dA_rk,
                                                                 dr_in, da_in, db_out, dk_out,
                                                                 dtot])
        return dr, dk, dv, dw, da, db, dh0, None, None, None


def dplr_chunk(r, k, v, w, a, b, scale, initial_state, output_final_state, cu_seqlens):
    """r, k: [B, T, H, K] and v [B, T, H, V] in one dtype; w, a, b [B, T, H, K] fp32;
    initial_state [N, H, K, V] fp32 or None. Returns (o [B, T, H, V] in r's dtype,
    final state [N, H, K, V] fp32 or None)."""
    r, k, v, w, a, b = (x.contiguous() for x in (r, k, v, w, a, b))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, ht = _DplrChunk.apply(r, k, v, w, a, b, h0, scale, bool(output_final_state), cu_seqlens)
    return o, (ht if output_final_state else None)
