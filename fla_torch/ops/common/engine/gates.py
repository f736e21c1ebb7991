"""Gate switch and gate-gap arithmetic shared by the engine kernels (Triton).

GATE_NONE: no decay. GATE_SCALAR: g [B*T, H] log-decay per head. GATE_KEY: g [B*T, H, K]
per key channel. Inside a kernel a gate tile is [BT, GW] with GW = BK (key gate) or 1 (scalar /
none), so every formula below broadcasts the same way for all three switches.

Accuracy: the in-chunk cumsum b of the log-decay is taken in fp64 and split into two fp32 parts
(hi = rounded, lo = rest). A decay gap b_i - b_j is then `gap(hi_i, lo_i, hi_j, lo_j)`, accurate
to fp32 relative to the gap itself, even where |b| reaches 1000s inside a chunk (gates of -20
per token), which a difference of two fp32 cumsums is not (~1e-4 relative error on exp(gap)).

The cumsum is taken once per chunk by `chunk_cumsum` and stored per slot (varlen.py): hi, lo
[slots * BT, H, K] (key gate) or [slots * BT, H] (scalar gate), fp32. Rows of a chunk past its
sequence's end hold the chunk's last cumsum (the gate counts as 0 there), so every exponent a
kernel forms from them stays finite and <= 0 where the live rows' would.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .varlen import n_slots, search_steps, slot_chunk

GATE_NONE = tl.constexpr(0)
GATE_SCALAR = tl.constexpr(1)
GATE_KEY = tl.constexpr(2)

# Largest decay (nats) across one 16-row sub-chunk for which a diagonal sub-block of the
# intra-chunk scores (and of their backward) is formed as one fp32-accurate dot through the
# sub-chunk's first row: its factors exp(+-gap) stay within e^20 and are exact fp32 numbers,
# and each pair's exponent error stays ~20 * 6e-8. Stronger decays take the per-pair path.
SPAN = tl.constexpr(20.0)


def gate_code(g, per_key: bool) -> int:
    """Host side: the GATE constexpr for a gate tensor (None -> none)."""
    if g is None:
        return GATE_NONE.value
    return GATE_KEY.value if per_key else GATE_SCALAR.value


@triton.jit
def load_gate(g, row, o_k, m_t, m_k, K: tl.constexpr, GATE: tl.constexpr, BR: tl.constexpr):
    """fp64 gate tile [BR, BK] (key gate) or [BR, 1] (scalar / none); masked rows are 0.
    row: [BR] flat indices token * H + head; o_k, m_k: this program's key channels."""
    if GATE == GATE_KEY:
        x = tl.load(g + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                    other=0.).to(tl.float64)
    elif GATE == GATE_SCALAR:
        x = tl.expand_dims(tl.load(g + row, mask=m_t, other=0.).to(tl.float64), 1)
    else:
        x = tl.zeros([BR, 1], dtype=tl.float64)
    return x


@triton.jit
def split(x):
    """fp64 -> (hi, lo) fp32 with hi + lo == x to ~2^-48 relative."""
    hi = x.to(tl.float32)
    lo = (x - hi.to(tl.float64)).to(tl.float32)
    return hi, lo


@triton.jit
def gap(hi_a, lo_a, hi_b, lo_b):
    """b_a - b_b (fp32) from split cumsums, never cancelling two large fp32 values."""
    return (hi_a - hi_b) + (lo_a - lo_b)


@triton.jit
def load_cum(ch, cl, srow, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
             GATE: tl.constexpr, BR: tl.constexpr):
    """(hi, lo) fp32 [BR, BK] (key gate) or [BR, 1] (scalar / none: zeros) of the stored split
    cumsum at slot rows srow [BR] (chunk_cumsum's layout)."""
    if GATE == GATE_KEY:
        p = (srow[:, None] * H + i_h) * K + o_k[None, :]
        hi = tl.load(ch + p, mask=m_k[None, :], other=0.)
        lo = tl.load(cl + p, mask=m_k[None, :], other=0.)
    elif GATE == GATE_SCALAR:
        p = (srow * H + i_h)[:, None]
        hi = tl.load(ch + p)
        lo = tl.load(cl + p)
    else:
        hi = tl.zeros([BR, 1], dtype=tl.float32)
        lo = tl.zeros([BR, 1], dtype=tl.float32)
    return hi, lo


@triton.jit
def load_cum_row(ch, cl, srow, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
                 GATE: tl.constexpr):
    """(hi, lo) fp32 [BK] (key gate) or [1] of the stored split cumsum at the one slot row srow."""
    if GATE == GATE_KEY:
        p = (srow * H + i_h) * K + o_k
        hi = tl.load(ch + p, mask=m_k, other=0.)
        lo = tl.load(cl + p, mask=m_k, other=0.)
    elif GATE == GATE_SCALAR:
        p = tl.zeros([1], dtype=tl.int64) + srow * H + i_h
        hi = tl.load(ch + p)
        lo = tl.load(cl + p)
    else:
        hi = tl.zeros([1], dtype=tl.float32)
        lo = tl.zeros([1], dtype=tl.float32)
    return hi, lo


@triton.jit
def load_decay_last(el, slot, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
                    GATE: tl.constexpr):
    """exp(last) fp32 of chunk `slot`: [BK] (key gate) or [1] (scalar gate), from chunk_cumsum."""
    if GATE == GATE_KEY:
        x = tl.load(el + (slot * H + i_h) * K + o_k, mask=m_k, other=0.)
    else:
        x = tl.load(el + tl.zeros([1], dtype=tl.int64) + slot * H + i_h)
    return x


@triton.jit
def _cumsum_kernel(g, k, ch, cl, kg, el, cu_seqlens, T, N, n_steps, H: tl.constexpr,
                   K: tl.constexpr, GK: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   GATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    slot, i_hk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_h, i_kb = i_hk % H, i_hk // H
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    t = c0 + o_t
    m_t = t < eos
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    x = load_gate(g, t * H + i_h, o_k, m_t, m_k, GK, GATE, BT)
    hi, lo = split(tl.cumsum(x, axis=0))
    l_hi, l_lo = split(tl.sum(x, axis=0))
    b_k = tl.load(k + (t[:, None] * H + i_h) * K + o_k[None, :],
                  mask=m_t[:, None] & m_k[None, :], other=0.)
    b_k = b_k * tl.exp(gap(l_hi[None, :], l_lo[None, :], hi, lo))
    tl.store(kg + (t[:, None] * H + i_h) * K + o_k[None, :], b_k.to(kg.dtype.element_ty),
             mask=m_t[:, None] & m_k[None, :])
    srow = slot * BT + o_t
    if GATE == GATE_KEY:
        p = (srow[:, None] * H + i_h) * K + o_k[None, :]
        tl.store(ch + p, hi, mask=m_k[None, :])
        tl.store(cl + p, lo, mask=m_k[None, :])
        tl.store(el + (slot * H + i_h) * K + o_k, tl.exp(l_hi + l_lo), mask=m_k)
    else:
        if i_kb == 0:
            p = (srow * H + i_h)[:, None]
            tl.store(ch + p, hi)
            tl.store(cl + p, lo)
            tl.store(el + tl.zeros([1], dtype=tl.int64) + slot * H + i_h, tl.exp(l_hi + l_lo))


def chunk_cumsum(g, k, gate: int, cu_seqlens, BT: int, BK: int, alloc):
    """The gate's in-chunk cumsum, once: returns (cum, kg, el) with
    cum = (hi, lo): the cumsum of g ([B, T, H] or [B, T, H, K] fp32 per `gate`) split into fp32,
          in the slot layout [slots * BT, H(, K)];
    kg = k * exp(last - b) [B, T, H, K] in k's dtype (every exponent <= 0);
    el = exp(last) [slots, H(, K)] fp32.
    GATE_NONE: (None, k, None)."""
    if gate == GATE_NONE.value:
        return None, k, None
    B, T, H, K = k.shape
    GK = K if gate == GATE_KEY.value else 1
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = n_slots(B, T, N, BT, cu_seqlens is not None)
    shape = (S * BT, H, K) if gate == GATE_KEY.value else (S * BT, H)
    ch, cl = alloc(shape, torch.float32), alloc(shape, torch.float32)
    kg = alloc(k.shape, k.dtype)
    el = alloc((S, H, K) if gate == GATE_KEY.value else (S, H), torch.float32)
    _cumsum_kernel[(S, H * triton.cdiv(K, BK))](
        g, k, ch, cl, kg, el, cu_seqlens if cu_seqlens is not None else g, T, N,
        search_steps(N), H=H, K=K, GK=GK, BT=BT, BK=BK, GATE=gate,
        IS_VARLEN=cu_seqlens is not None, num_warps=4)
    return (ch, cl), kg, el
