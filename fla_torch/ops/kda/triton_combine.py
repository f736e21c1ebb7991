"""The last stages of chunk_kda's backward (Triton): the key-score backward and the combine.

key_score_bwd: the gradient dAk of the key scores Ak_ij = sum_c k_ic k_jc exp(b_ic - b_jc)
(j < i; engine/wy.py) taken to k through the engine's intra-chunk score backward
(output_stage._bwd_intra_kernel on (k, k)):
    row_i = sum_{j < i} dAk_ij exp(b_i - b_j) k_j,   col_j = sum_{i > j} dAk_ij exp(b_i - b_j) k_i
combine, per token s and key channel (b the in-chunk cumsum of g):
    dk   = dk_o + row + col + dkb exp(b)               (dk_o: output_bwd's dk; dkb: wy_bwd's)
    db_s = k_s (row_s - col_s) + dkb_s k_s exp(b_s)    (the gradient of b from the WY terms)
    dg_s = dg_o,s + sum_{t >= s in the chunk} db_t     (dg_o: output_bwd's dg)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.engine.gates import GATE_KEY, load_cum
from ..common.engine.launch import launch_for
from ..common.engine.output_stage import _bwd_intra_kernel
from ..common.engine.varlen import n_slots, search_steps, slot_chunk

BT = 64


def _grid(k, cu_seqlens):
    B, T = k.shape[0], k.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return n_slots(B, T, N, BT, cu_seqlens is not None), T, N


def key_score_bwd(k, cum, dAk, cu_seqlens, prec: str, alloc):
    """(row, col) [slots * BT, H, K] fp32 (see the module docstring) from k [B, T, H, K],
    the split cumsum cum = (hi, lo) (gates.chunk_cumsum) and dAk [slots * BT, H, BT] fp32."""
    H, K = k.shape[2], k.shape[3]
    cfg = launch_for("output_bwd_intra", K, K, k.dtype)
    S, T, N = _grid(k, cu_seqlens)
    row = alloc((S * BT, H, K), torch.float32)
    col = alloc((S * BT, H, K), torch.float32)
    _bwd_intra_kernel[(S, H * triton.cdiv(K, cfg.BK))](
        k, k, cum[0], cum[1], dAk, row, col, cu_seqlens if cu_seqlens is not None else k, T, N,
        search_steps(N), H=H, K=K, BT=BT, BC=cfg.BC, BK=cfg.BK, GATE=GATE_KEY,
        IS_VARLEN=cu_seqlens is not None, PREC=prec, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return row, col


@triton.jit
def _combine_kernel(k, ch, cl, dk_o, dg_o, dkb, row, col, dk, dg, cu_seqlens, T, N, n_steps,
                    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    IS_VARLEN: tl.constexpr):
    slot, i_hk = tl.program_id(0), tl.program_id(1)
    i_h, i_kb = i_hk % H, i_hk // H
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    t = c0 + o_t
    m = (t < eos)[:, None] & m_k[None, :]
    s_f = slot.to(tl.int64) * BT + o_t
    hi, lo = load_cum(ch, cl, s_f, i_h, o_k, m_k, H, K, GATE_KEY, BT)
    eb = tl.exp(hi + lo)
    p = (t[:, None] * H + i_h) * K + o_k[None, :]
    p_s = (s_f[:, None] * H + i_h) * K + o_k[None, :]
    b_k = tl.load(k + p, mask=m, other=0.).to(tl.float32)
    b_dkb = tl.load(dkb + p, mask=m, other=0.)
    b_r = tl.load(row + p_s, mask=m, other=0.)
    b_c = tl.load(col + p_s, mask=m, other=0.)
    b_dk = tl.load(dk_o + p, mask=m, other=0.).to(tl.float32) + b_r + b_c + b_dkb * eb
    tl.store(dk + p, b_dk.to(dk.dtype.element_ty), mask=m)
    db = b_k * (b_r - b_c + b_dkb * eb)
    b_dg = tl.load(dg_o + p, mask=m, other=0.) + tl.sum(db, axis=0)[None, :] \
        - tl.cumsum(db, axis=0) + db
    tl.store(dg + p, b_dg, mask=m)


def combine(k, cum, dk_o, dg_o, dkb, row, col, cu_seqlens, alloc):
    """(dk [B, T, H, K] in k's dtype, dg [B, T, H, K] fp32): see the module docstring."""
    H, K = k.shape[2], k.shape[3]
    S, T, N = _grid(k, cu_seqlens)
    BK = min(64, triton.next_power_of_2(max(K, 16)))
    dk = alloc(k.shape, k.dtype)
    dg = alloc(k.shape, torch.float32)
    _combine_kernel[(S, H * triton.cdiv(K, BK))](
        k, cum[0], cum[1], dk_o, dg_o, dkb, row, col, dk, dg,
        cu_seqlens if cu_seqlens is not None else k, T, N, search_steps(N), H=H, K=K, BT=BT,
        BK=BK, IS_VARLEN=cu_seqlens is not None, num_warps=4)
    return dk, dg
