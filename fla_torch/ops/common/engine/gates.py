"""Gate switch and gate-gap arithmetic shared by the engine kernels (Triton).

GATE_NONE: no decay. GATE_SCALAR: g [B*T, H] log-decay per head. GATE_KEY: g [B*T, H, K]
per key channel. Inside a kernel a gate tile is [BT, GW] with GW = BK (key gate) or 1 (scalar /
none), so every formula below broadcasts the same way for all three switches.

Accuracy: the in-chunk cumsum b of the log-decay is taken in fp64 and split into two fp32 parts
(hi = rounded, lo = rest). A decay gap b_i - b_j is then `gap(hi_i, lo_i, hi_j, lo_j)`, accurate
to fp32 relative to the gap itself, even where |b| reaches 1000s inside a chunk (gates of -20
per token), which a difference of two fp32 cumsums is not (~1e-4 relative error on exp(gap)).
"""
from __future__ import annotations

import triton
import triton.language as tl

GATE_NONE = tl.constexpr(0)
GATE_SCALAR = tl.constexpr(1)
GATE_KEY = tl.constexpr(2)


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
def pick_row(x, o, j):
    """Row j of a 2-D tile x (o = arange over its rows), as a 1-D tensor (exact)."""
    return tl.sum(tl.where(o[:, None] == j, x, 0.), axis=0)


@triton.jit
def pick_col(x, o, j):
    """Column j of a 2-D tile x (o = arange over its columns), as a 1-D tensor (exact)."""
    return tl.sum(tl.where(o[None, :] == j, x, 0.), axis=1)


@triton.jit
def load_gate_row(g, t, i_h, eos, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
                  GATE: tl.constexpr):
    """fp64 gate of the single token t ([BK] key gate, [1] scalar / none); 0 at t >= eos."""
    if GATE == GATE_KEY:
        x = tl.load(g + (t * H + i_h) * K + o_k, mask=m_k & (o_k * 0 + t < eos),
                    other=0.).to(tl.float64)
    elif GATE == GATE_SCALAR:
        o_1 = tl.zeros([1], dtype=tl.int64) + t
        x = tl.load(g + o_1 * H + i_h, mask=o_1 < eos, other=0.).to(tl.float64)
    else:
        x = tl.zeros([1], dtype=tl.float64)
    return x
