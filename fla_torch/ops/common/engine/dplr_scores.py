"""Per-key-decay scores of a DPLR chunk (Triton): the forward, and the helpers its backward
(dplr_scores_bwd.py) shares.

Inputs in the token layout [B, T, H, K] (r, k in their dtype, a, b and the log-decay w fp32),
read through dplr.py's slot-row -> token map (pad rows read as zero); outputs fp32 in the slot
layout [S, H, BT, *]; the backward writes dr, dk, da, db, dw to the token layout, each in its
input's dtype. Per chunk, with G_i = w_1 + ... + w_i (fp64 cumsum inside the chunk, per key),
Gx_i = G_{i-1} and L = G at the chunk's last row:
    A_ab[i, j] = sum_c a_ic b_jc exp(Gx_ic - G_jc)    (j < i)     A_ak likewise with k_j
    A_rb[i, j] = sum_c r_ic b_jc exp(G_ic - G_jc)      (j <= i)    A_rk likewise with k_j
    r_in = r exp(G), a_in = a exp(Gx), b_out = b exp(L - G), k_out = k exp(L - G),
    tot = exp(L)                                                          [S, H, K]
A_ab is computed as its row-shifted form A_ab[m + 1, j] = sum_c a_{m+1,c} b_jc exp(G_m - G_j)
(j <= m), so all four matrices pair one row vector x in {r, a shifted up} with one column
vector y in {b, k} through exp(G_i - G_j), j <= i.

Sub-chunks of BC rows: the pairs of earlier sub-chunks factor through a reference row between
them (x_i exp(G_i - G_f), y_j exp(G_f - G_j): every exponent <= 0) into tensor-core dots
(fp32-accurate; for a bf16 op both operands rounded to bf16, as KDA's delta_scores). The
diagonal sub-block factors through its own first row f when the decay across it stays under
gates.SPAN (every channel's G_f - G_last < SPAN: the factors exp(G_i - G_f) >= e^-SPAN and
exp(G_f - G_j) <= e^SPAN are exact fp32 numbers, so one fp32-accurate dot gives every pair to
fp32 accuracy), forward and backward; beyond the span it is exact per pair (a loop over the
sub-chunk's columns). Every exponent is a difference of fp64 cumsums taken before the cast to fp32
and masked to -inf outside the causal part before exp: no overflow at gates of -20.

The forward is two kernels: _dplr_vectors_fwd per (slot, head, key block): G to an fp64
buffer, r_in, a_in, b_out, k_out, tot; _dplr_scores_fwd per (slot, head, sub-chunk): its rows
of the four matrices, the earlier sub-chunks in one pass over K and the diagonal block in a
second (one program per chunk holding both spilled registers on sm_90).

Backward (dplr_scores_bwd.py): the gradients of r, k, a, b by the same pairs, and dw per
chunk without carrying anything across chunks: each pair (i, j), i > j, gives its coefficient
c = dA_ij x_i y_j exp(.) to every w_s with j < s <= i, gathered as P_i (row side) and M_j
(column side), dw_s = sum_{t >= s} (P_t - M_t); the pairs i == j depend on no gate and are left
out, so no O(1) term is formed and cancelled under strong gates. The boundary terms go the same
way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_alloc import alloc
from ..triton_scalar_gate import block, fp32_dot_precision
from .gates import SPAN


@triton.jit
def _ld(x, base, rows, m_r, o_k, m_k, K: tl.constexpr, BT: tl.constexpr):
    """Tile [len(rows), BK] of x [S, H, BT, K] (program row base `base`), masked."""
    return tl.load(x + (base * BT + rows)[:, None] * K + o_k[None, :],
                   mask=m_r[:, None] & m_k[None, :], other=0.)


@triton.jit
def _st(x, val, base, rows, m_r, o_k, m_k, K: tl.constexpr, BT: tl.constexpr):
    tl.store(x + (base * BT + rows)[:, None] * K + o_k[None, :], val.to(x.dtype.element_ty),
             mask=m_r[:, None] & m_k[None, :])


@triton.jit
def _tk(tok, i_s, rows, m_r, BT: tl.constexpr):
    """Flat token indices [len(rows)] of slot rows `rows` of slot i_s (-1: pad or masked)."""
    return tl.load(tok + i_s * BT + rows, mask=m_r, other=-1)


@triton.jit
def _sub_rows(tok, i_s, i0, BT: tl.constexpr, BC: tl.constexpr):
    """Slot rows i0 .. i0 + BC of slot i_s: (rows, m_r: rows in the chunk, m_a: rows + 1 in the
    chunk (the shifted A_ab / A_ak rows), t_I: their tokens, t_Ia: the tokens of rows + 1)."""
    rows = i0 + tl.arange(0, BC)
    m_r = rows < BT
    m_a = rows + 1 < BT
    return rows, m_r, m_a, _tk(tok, i_s, rows, m_r, BT), _tk(tok, i_s, rows + 1, m_a, BT)


@triton.jit
def _ldx(x, t, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    """fp32 tile [len(t), BK] of x [B, T, H, K] at flat tokens t (0 where t < 0)."""
    return tl.load(x + (t * H + i_h)[:, None] * K + o_k[None, :],
                   mask=(t >= 0)[:, None] & m_k[None, :], other=0.).to(tl.float32)


@triton.jit
def _stx(x, val, t, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    tl.store(x + (t * H + i_h)[:, None] * K + o_k[None, :], val.to(x.dtype.element_ty),
             mask=(t >= 0)[:, None] & m_k[None, :])


@triton.jit
def _ldx_row(x, tok, i_s, r, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
             BT: tl.constexpr):
    """fp32 row [BK] of x [B, T, H, K] at slot row r of slot i_s (0 on a pad row)."""
    t = tl.load(tok + i_s * BT + r)
    return tl.load(x + (t * H + i_h) * K + o_k, mask=m_k & (o_k * 0 + t >= 0),
                   other=0.).to(tl.float32)


@triton.jit
def _ex(d):
    """exp of an fp64 exponent (<= 0) in fp32."""
    return tl.exp(d.to(tl.float32))


@triton.jit
def _diag_span(gbuf, base, i0, G_I, o_k, m_k, K: tl.constexpr, BT: tl.constexpr,
               BC: tl.constexpr):
    """(whether every channel decays by less than SPAN across the sub-chunk at row i0, so its
    diagonal block is one dot through its first row; e_f = G_I - G there [BC, BK] fp64, <= 0
    and > -SPAN when it fits)."""
    G_f0 = tl.load(gbuf + (base * BT + i0) * K + o_k, mask=m_k, other=0.)
    G_l0 = tl.load(gbuf + (base * BT + i0 + BC - 1) * K + o_k, mask=m_k, other=0.)
    return tl.max(G_f0 - G_l0) < SPAN, G_I - G_f0[None, :]


@triton.jit
def _cumsum_pass(w, t_all, i_h, gbuf, base, o_t, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
                 BT: tl.constexpr):
    """fp64 in-chunk cumsum G [BT, BK] of w (stored to gbuf), its last row L [BK] and w itself
    (fp64 [BT, BK])."""
    m_t = o_t < BT
    x = _ldx(w, t_all, i_h, o_k, m_k, H, K).to(tl.float64)
    G = tl.cumsum(x, axis=0)
    _st(gbuf, G, base, o_t, m_t, o_k, m_k, K, BT)
    return G, tl.sum(x, axis=0), x


@triton.jit
def _dplr_vectors_fwd(r, k, a, b, w, tok, gbuf, Aab, Aak, rin, ain, bout, kout, tot,
                      H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """Per (slot, head, key block): the fp64 cumsum G (to gbuf), r_in, a_in, b_out, k_out, tot,
    and row 0 of A_ab, A_ak (no j < 0)."""
    i_s, i_h, kb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    base = i_s * H + i_h
    o_t = tl.arange(0, BT)
    m_t = o_t < BT
    t_all = _tk(tok, i_s, o_t, m_t, BT)
    o_k = kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    G, L, x = _cumsum_pass(w, t_all, i_h, gbuf, base, o_t, o_k, m_k, H, K, BT)
    e_end = _ex(L[None, :] - G)
    _st(rin, _ldx(r, t_all, i_h, o_k, m_k, H, K) * _ex(G), base, o_t, m_t, o_k, m_k, K, BT)
    _st(ain, _ldx(a, t_all, i_h, o_k, m_k, H, K) * _ex(G - x), base, o_t, m_t, o_k, m_k, K, BT)
    _st(bout, _ldx(b, t_all, i_h, o_k, m_k, H, K) * e_end, base, o_t, m_t, o_k, m_k, K, BT)
    _st(kout, _ldx(k, t_all, i_h, o_k, m_k, H, K) * e_end, base, o_t, m_t, o_k, m_k, K, BT)
    tl.store(tot + base * K + o_k, _ex(L), mask=m_k)
    if kb == 0:
        zrow = tl.zeros([BT], dtype=tl.float32)
        tl.store(Aab + base * BT * BT + o_t, zrow)
        tl.store(Aak + base * BT * BT + o_t, zrow)


@triton.jit
def _dplr_scores_fwd(r, k, a, b, tok, gbuf, Aab, Aak, Arb, Ark,
                     H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     BK: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Per (slot, head, sub-chunk I): rows i0 .. i0 + BC of A_rb, A_rk and the shifted rows of
    A_ab, A_ak; the earlier sub-chunks' columns in one pass over K, the diagonal block in a
    second (fewer registers live at once)."""
    i_s, i_h, I = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    base = i_s * H + i_h
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    m_t = o_t < BT
    t_all = _tk(tok, i_s, o_t, m_t, BT)
    NK: tl.constexpr = (K + BK - 1) // BK
    i0 = I * BC
    rows, m_r, m_a, t_I, t_Ia = _sub_rows(tok, i_s, i0, BT, BC)
    p_r = (base * BT + rows)[:, None] * BT
    p_a = p_r + BT          # the shifted rows m + 1
    off = (o_t[None, :] < i0) | (o_t[None, :] >= i0 + BC)
    o_rb = tl.zeros([BC, BT], dtype=tl.float32)
    o_rk = tl.zeros([BC, BT], dtype=tl.float32)
    o_ab = tl.zeros([BC, BT], dtype=tl.float32)
    o_ak = tl.zeros([BC, BT], dtype=tl.float32)
    if I > 0:
        m_j = o_t < i0
        t_j = tl.where(m_j, t_all, -1)
        for kb in range(NK):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            G_I = _ld(gbuf, base, rows, m_r, o_k, m_k, K, BT)
            G_f = tl.load(gbuf + (base * BT + i0) * K + o_k, mask=m_k, other=0.)
            G_a = _ld(gbuf, base, o_t, m_j, o_k, m_k, K, BT)
            e_c = _ex(tl.where(m_j[:, None], G_f[None, :] - G_a, float("-inf")))
            c_b = _ldx(b, t_j, i_h, o_k, m_k, H, K) * e_c
            c_k = _ldx(k, t_j, i_h, o_k, m_k, H, K) * e_c
            e_r = _ex(G_I - G_f[None, :])
            r_d = _ldx(r, t_I, i_h, o_k, m_k, H, K) * e_r
            a_d = _ldx(a, t_Ia, i_h, o_k, m_k, H, K) * e_r
            o_rb += _dot(r_d, tl.trans(c_b), DT, PREC)
            o_rk += _dot(r_d, tl.trans(c_k), DT, PREC)
            o_ab += _dot(a_d, tl.trans(c_b), DT, PREC)
            o_ak += _dot(a_d, tl.trans(c_k), DT, PREC)
    tl.store(Arb + p_r + o_t[None, :], o_rb.to(Arb.dtype.element_ty), mask=m_r[:, None] & off)
    tl.store(Ark + p_r + o_t[None, :], o_rk.to(Ark.dtype.element_ty), mask=m_r[:, None] & off)
    tl.store(Aab + p_a + o_t[None, :], o_ab, mask=m_a[:, None] & off)
    tl.store(Aak + p_a + o_t[None, :], o_ak, mask=m_a[:, None] & off)
    d_rb = tl.zeros([BC, BC], dtype=tl.float32)
    d_rk = tl.zeros([BC, BC], dtype=tl.float32)
    d_ab = tl.zeros([BC, BC], dtype=tl.float32)
    d_ak = tl.zeros([BC, BC], dtype=tl.float32)
    for kb in range(NK):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        x_r = _ldx(r, t_I, i_h, o_k, m_k, H, K)
        x_a = _ldx(a, t_Ia, i_h, o_k, m_k, H, K)
        G_I = _ld(gbuf, base, rows, m_r, o_k, m_k, K, BT)
        fits, e_f = _diag_span(gbuf, base, i0, G_I, o_k, m_k, K, BT, BC)
        if fits:
            f_in = _ex(e_f)
            f_out = _ex(-e_f)
            r_f = x_r * f_in
            a_f = x_a * f_in
            b_f = tl.trans(_ldx(b, t_I, i_h, o_k, m_k, H, K) * f_out)
            k_f = tl.trans(_ldx(k, t_I, i_h, o_k, m_k, H, K) * f_out)
            d_rb += tl.dot(r_f, b_f, input_precision="tf32x3")
            d_rk += tl.dot(r_f, k_f, input_precision="tf32x3")
            d_ab += tl.dot(a_f, b_f, input_precision="tf32x3")
            d_ak += tl.dot(a_f, k_f, input_precision="tf32x3")
        else:
            for j in range(BC):
                G_j = tl.load(gbuf + (base * BT + i0 + j) * K + o_k, mask=m_k, other=0.)
                e = _ex(tl.where(o_c[:, None] >= j, G_I - G_j[None, :], float("-inf")))
                yb_j = _ldx_row(b, tok, i_s, i0 + j, i_h, o_k, m_k, H, K, BT)
                yk_j = _ldx_row(k, tok, i_s, i0 + j, i_h, o_k, m_k, H, K, BT)
                xr_e = x_r * e
                xa_e = x_a * e
                at_j = o_c[None, :] == j
                d_rb += tl.where(at_j, tl.sum(xr_e * yb_j[None, :], axis=1)[:, None], 0.)
                d_rk += tl.where(at_j, tl.sum(xr_e * yk_j[None, :], axis=1)[:, None], 0.)
                d_ab += tl.where(at_j, tl.sum(xa_e * yb_j[None, :], axis=1)[:, None], 0.)
                d_ak += tl.where(at_j, tl.sum(xa_e * yk_j[None, :], axis=1)[:, None], 0.)
    tri = o_c[:, None] >= o_c[None, :]
    tl.store(Arb + p_r + i0 + o_c[None, :], tl.where(tri, d_rb, 0.).to(Arb.dtype.element_ty),
             mask=m_r[:, None])
    tl.store(Ark + p_r + i0 + o_c[None, :], tl.where(tri, d_rk, 0.).to(Ark.dtype.element_ty),
             mask=m_r[:, None])
    tl.store(Aab + p_a + i0 + o_c[None, :], tl.where(tri, d_ab, 0.), mask=m_a[:, None])
    tl.store(Aak + p_a + i0 + o_c[None, :], tl.where(tri, d_ak, 0.), mask=m_a[:, None])


@triton.jit
def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    """a @ b accumulated in fp32 for the stages after the scores: DT fp32 -> an fp32 dot of
    precision PREC; DT bf16 (a bf16 op: its intermediates are stored in bf16, as KDA's) -> both
    operands in bf16, one native 16-bit tensor-core dot."""
    if DT == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    else:
        return tl.dot(a.to(DT), b.to(DT))


def inter_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the DPLR pipeline's vectors, WY terms and states for inputs of
    `dtype`: bf16 for bf16 (fp32's exponent range: no underflow), fp32 otherwise (fp16's
    exp(G) turns subnormal under strong decays)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def dot_dtype(dtype: torch.dtype):
    """The constexpr DT of `_dot` for intermediates stored in `dtype`."""
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float32


@triton.jit
def _ldA(A, base, rows, m_r, cols, m_c, BT: tl.constexpr):
    return tl.load(A + (base * BT + rows)[:, None] * BT + cols[None, :],
                   mask=m_r[:, None] & m_c[None, :], other=0.)


@triton.jit
def _diag(x, o_c):
    """Diagonal [BC] of a [BC, BC] tile."""
    return tl.sum(tl.where(o_c[:, None] == o_c[None, :], x, 0.), axis=1)


BC = 16
BT = 64
# the scores kernel's key block and warps (the vectors kernel: 4 warps, key blocks of 16).
# H100 bf16 B4 T4096 H16 K64: BK 16 / 4 warps 1.86 ms, 32 / 4 2.06, 16 / 8 3.41, 32 / 8 3.22
# (one program per chunk and head, 16 / 8: 2.83 ms). Session 9 (bf16 dots with other
# sub-chunks), call 5, RWKV-7 fwd: 2 warps 2.00 ms, 4 warps + maxnreg 168 2.14, 4 warps 2.30,
# BK 32 3.37; call 7: 1 warp 1.77 (2 warps 1.93). BK_vec: the vectors kernel's key block
# (call 7: 32 -0.04 ms against 16).
LAUNCH = dict(BK=16, num_warps=1, maxnreg=None, BK_vec=32)


def scores_fwd(r, k, a, b, w, tok):
    """r, k, a, b, w [B, T, H, K] (token layout, contiguous; r, k in one dtype, a, b, w fp32),
    tok [S * BT] int64: the flat token of every slot row, -1 on pad rows. Returns (A_ab, A_ak
    [S, H, BT, BT] fp32, A_rb, A_rk [S, H, BT, BT] and r_in, a_in, b_out, k_out [S, H, BT, K]
    in inter_dtype(r.dtype), tot [S, H, K] fp32) in the slot layout, and the fp64 in-chunk
    cumsum G [S, H, BT, K] (the backward reads it)."""
    H, K = r.shape[2], r.shape[3]
    S = tok.shape[0] // BT
    dev = r.device
    # A_rb, A_rk feed only the output stage, whose dots take them in inter_dtype
    mats = [alloc((S, H, BT, BT), dt, dev)
            for dt in (torch.float32, torch.float32, inter_dtype(r.dtype), inter_dtype(r.dtype))]
    vecs = [alloc((S, H, BT, K), inter_dtype(r.dtype), dev) for _ in range(4)]
    tot = alloc((S, H, K), torch.float32, dev)
    gbuf = alloc((S, H, BT, K), torch.float64, dev)
    BKV = min(block(K), LAUNCH["BK_vec"])
    _dplr_vectors_fwd[(S, H, triton.cdiv(K, BKV))](r, k, a, b, w, tok, gbuf, mats[0], mats[1],
                                                   *vecs, tot, H=H, K=K, BT=BT, BK=BKV,
                                                   num_warps=4)
    _dplr_scores_fwd[(S, H, BT // BC)](r, k, a, b, tok, gbuf, *mats, H=H, K=K, BT=BT, BC=BC,
                                       BK=min(block(K), LAUNCH["BK"]), PREC=fp32_dot_precision(),
                                       DT=dot_dtype(r.dtype),
                                       num_warps=LAUNCH["num_warps"], num_stages=1,
                                       maxnreg=LAUNCH["maxnreg"])
    return (*mats, *vecs, tot, gbuf)
