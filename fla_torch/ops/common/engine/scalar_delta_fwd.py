"""Forward Triton kernels of the chunked (gated) delta rule (WY / UT transform), chunk BT = 64.

Per chunk (tokens s, r of one sequence and value head; gc = chunk-local cumsum of g, fp32):
    A[s, r]  = beta_s (k_s . k_r) exp(gc_s - gc_r)   for r < s, else 0
    Tm       = (I + A)^-1                 (forward substitution in registers, fp32)
    w        = Tm (beta exp(gc) k)        [BT, K]      u = Tm (beta v)   [BT, V]
               (stored as exp(-gc_first) w, fp16-safe: see first_gate)
    vn       = u - w h                    (h: state at the chunk start, [K, V])
    h_next   = exp(gc_L) h + (exp(gc_L - gc) k)^T vn          (L: last token of the chunk)
    o        = scale (exp(gc) q h + (causal(q k^T) * exp(gc_t - gc_s)) vn)
Kernels: `wy_fwd` (gc split in fp32 hi + lo, Tm, w, u; in scalar_wy_fwd.py), `chunk_h`
(sequential over the chunks of a sequence; one program per value block x sequence x value
head; stores h per chunk and vn), `chunk_o` (one program per value block x chunk x head).
All decays are exp of a non-positive number: masked entries are masked in the exponent.
Time is the flattened B*T axis; per-chunk buffers and chunk-parallel grids use varlen.py's
slots (`chunk_coords` maps a slot to its sequence and first token inside the kernel).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .varlen import chunk_slot, slot_chunk

BT = 64


@triton.jit
def chunk_coords(offsets, slot, N, n_steps, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Slot (varlen.py's scheme, no host sync) -> (sequence n, first token t0, end of the
    sequence eos). A slot of no chunk gives t0 == eos: its program returns at once."""
    return slot_chunk(offsets, slot, N, n_steps, T, BT, IS_VARLEN)


@triton.jit
def load_gates(gc_buf, gc_lo, rows, mask_t, t_last, i_hv, HV: tl.constexpr,
               HAS_G: tl.constexpr):
    """(gc [BT], gc_lo [BT], gc and gc_lo at the chunk's last valid token), fp32; zeros
    without a gate. gc + gc_lo is the chunk-local cumsum to fp64 accuracy (split by `wy_fwd`):
    under strong gates gc reaches -1000s inside a chunk, where fp32 spacing (6e-5 at 640) would
    put that much relative error on every decay exp(gc_t - gc_s); gaps are therefore taken as
    (gc_t - gc_s) + (lo_t - lo_s) (`decay_matrix`, `decay_to_end`). exp(gc) alone needs no lo:
    its relative error |lo| <= 6e-8 |gc| only matters where exp(gc) has underflowed.

    Padded rows (past the end of the sequence) get the last token's values, as if their g were
    0: every decay gap exp(gc_t - gc_s) with t >= s then stays exp of a non-positive number
    even for a padded t. (Zeros there would make exp(0 - gc_s) = inf under strong gates,
    and inf * 0 = NaN would reach valid rows through dots over the time axis.)"""
    if HAS_G:
        g_last = tl.load(gc_buf + t_last * HV + i_hv)
        l_last = tl.load(gc_lo + t_last * HV + i_hv)
        b_gc = tl.load(gc_buf + rows * HV + i_hv, mask=mask_t, other=0.0)
        b_lo = tl.load(gc_lo + rows * HV + i_hv, mask=mask_t, other=0.0)
        b_gc = tl.where(mask_t, b_gc, g_last)
        b_lo = tl.where(mask_t, b_lo, l_last)
    else:
        b_gc = tl.zeros([rows.shape[0]], dtype=tl.float32)
        b_lo = b_gc
        g_last = 0.0
        l_last = 0.0
    return b_gc, b_lo, g_last, l_last


@triton.jit
def decay_matrix(r_gc, r_lo, c_gc, c_lo, keep):
    """exp(gap) with gap = (r_gc[:, None] - c_gc[None, :]) + (r_lo[:, None] - c_lo[None, :])
    where keep, else 0 (masked in the exponent)."""
    gap = (r_gc[:, None] - c_gc[None, :]) + (r_lo[:, None] - c_lo[None, :])
    return tl.where(keep, tl.exp(tl.where(keep, gap, 0.0)), 0.0)


@triton.jit
def first_gate(gc_buf, t0, i_hv, HV: tl.constexpr, HAS_G: tl.constexpr):
    """gc at the chunk's first token (fp32; 0 without a gate; given gc_lo, its lo part).
    w is stored as
    Tm diag(beta exp(gc - gc_first)) k (its largest row unscaled, fp16-safe under strong
    gates); its users multiply their products with w by exp(gc_first) in fp32."""
    if HAS_G:
        g0 = tl.load(gc_buf + t0 * HV + i_hv)
    else:
        g0 = 0.0
    return g0


@triton.jit
def decay_to_end(b_gc, b_lo, g_last, l_last, mask_t):
    """exp(gc_L - gc_s) per row s [BT] (1 on padded rows), gap taken with the lo parts."""
    return tl.exp(tl.where(mask_t, (g_last - b_gc) + (l_last - b_lo), 0.0))


@triton.jit
def _chunk_h_kernel(k, w_buf, u_buf, gc_buf, gc_lo, h0, h_buf, vn_buf, ht, offsets, T,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, IS_VARLEN: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr,
                    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    """Sequential over the chunks of one sequence: h_buf[c] = state at the start of chunk c
    (operand dtype), vn = u - w h (operand dtype), ht = final state (fp32)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(offsets + i_n).to(tl.int64)
    eos = tl.load(offsets + i_n + 1).to(tl.int64)
    c0 = chunk_slot(i_n, bos, 0, T, BT, IS_VARLEN)
    nc = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    DT = k.dtype.element_ty
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + (i_n * HV + i_hv).to(tl.int64) * K * V + p_kv, mask=mask_kv,
                       other=0.0)
    for i in range(0, nc):
        t0 = bos + i * BT
        rows = t0 + o_t
        mask_t = rows < eos
        t_last = tl.minimum(t0 + BT, eos) - 1
        tl.store(h_buf + ((c0 + i) * HV + i_hv) * K * V + p_kv, b_h.to(h_buf.dtype.element_ty),
                 mask=mask_kv)
        m_tk = mask_t[:, None] & mask_k[None, :]
        m_tv = mask_t[:, None] & mask_v[None, :]
        b_w = tl.load(w_buf + (rows * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_tk,
                      other=0.0)
        b_u = tl.load(u_buf + (rows * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_tv,
                      other=0.0)
        b_wh = tl.dot(b_w.to(DT), b_h.to(DT), input_precision=PREC)
        b_vn = b_u.to(tl.float32) - tl.exp(first_gate(gc_buf, t0, i_hv, HV, HAS_G)) * b_wh
        tl.store(vn_buf + (rows * HV + i_hv)[:, None] * V + o_v[None, :],
                 b_vn.to(vn_buf.dtype.element_ty), mask=m_tv)
        b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        if HAS_G:
            b_gc, b_lo, g_last, l_last = load_gates(gc_buf, gc_lo, rows, mask_t, t_last, i_hv,
                                                    HV, HAS_G)
            b_vn = b_vn * decay_to_end(b_gc, b_lo, g_last, l_last, mask_t)[:, None]
            b_h = b_h * tl.exp(g_last)
        b_h += tl.dot(tl.trans(b_k), b_vn.to(DT), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + p_kv, b_h, mask=mask_kv)


@triton.jit
def _chunk_o_kernel(q, k, vn_buf, h_buf, gc_buf, gc_lo, o, offsets, N, n_steps, T, scale,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, IS_VARLEN: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr,
                    PREC: tl.constexpr):
    i_v, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_coords(offsets, i_c, N, n_steps, T, BT, IS_VARLEN)
    if t0 >= eos:      # a slot of no chunk
        return
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    mask_t = rows < eos
    o_v = i_v * BV + tl.arange(0, BV)
    mask_v = o_v < V
    m_tv = mask_t[:, None] & mask_v[None, :]
    DT = q.dtype.element_ty
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = mask_t[:, None] & (o_k < K)[None, :]
        b_q = tl.load(q + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_h = tl.load(h_buf + (i_c.to(tl.int64) * HV + i_hv) * K * V + o_k[:, None] * V
                      + o_v[None, :], mask=(o_k < K)[:, None] & mask_v[None, :], other=0.0)
        b_o += tl.dot(b_q, b_h.to(DT), input_precision=PREC)
        b_A += tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    causal = o_t[:, None] >= o_t[None, :]
    if HAS_G:
        b_gc, b_lo, g_last, l_last = load_gates(gc_buf, gc_lo, rows, mask_t,
                                                tl.minimum(t0 + BT, eos) - 1, i_hv, HV, HAS_G)
        b_o = b_o * tl.exp(b_gc)[:, None]
        b_A = b_A * decay_matrix(b_gc, b_lo, b_gc, b_lo, causal)
    else:
        b_A = tl.where(causal, b_A, 0.0)
    b_vn = tl.load(vn_buf + (rows * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_o = (b_o + tl.dot(b_A.to(DT), b_vn.to(DT), input_precision=PREC)) * scale
    tl.store(o + (rows * HV + i_hv)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_tv)
