"""fp32-accurate products of an fp32 matrix with a 16-bit operand on 16-bit tensor cores.

`split_dot(a, b, PREC)`: a [M, K] fp32, b [K, N] in the input dtype. For a 16-bit b the fp32
a is split as a = hi + lo with hi = a rounded to b's dtype and lo = the remainder rounded to
b's dtype; a b = hi b + lo b, two exact 16-bit tensor-core products accumulated in fp32. The
relative error of the split is ~2^-17 (bf16) / ~2^-22 (fp16), against 2^-11 for plain tf32,
at the cost of two bf16 products instead of the three (half-rate) tf32 products of "tf32x3".
For an fp32 b it is one dot at `PREC` (fp32 inputs keep "tf32x3").
fp16 range: hi must stay below 65504 (the forward uses it for Tm-based products only, whose
entries are O(1)).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_dot(a, b, PREC: tl.constexpr):
    """a [M, K] fp32 times b [K, N] (bf16 / fp16 / fp32) -> [M, N] fp32."""
    if b.dtype == tl.float32:
        out = tl.dot(a, b, input_precision=PREC)
    else:
        a_hi = a.to(b.dtype)
        a_lo = (a - a_hi.to(tl.float32)).to(b.dtype)
        out = tl.dot(a_hi, b) + tl.dot(a_lo, b)
    return out


@triton.jit
def _bf16_pair(x):
    """x (fp32 or fp16) -> (hi, lo) bf16 with hi + lo = x to ~2^-17 (exact for fp16 x)."""
    x = x.to(tl.float32)
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def split_dot_wide(a, b, PREC: tl.constexpr):
    """Like `split_dot`, with the split always in bf16 (fp32's range: for gradients, which may
    exceed fp16's). bf16 b: hi b + lo b. fp16 b: b is split exactly into bf16 hi + lo too and
    the three leading products are kept (a_lo b_lo, ~2^-17 relative, is dropped). fp32 b:
    one dot at PREC."""
    if b.dtype == tl.float32:
        out = tl.dot(a, b, input_precision=PREC)
    elif b.dtype == tl.bfloat16:
        a_hi, a_lo = _bf16_pair(a)
        out = tl.dot(a_hi, b) + tl.dot(a_lo, b)
    else:
        a_hi, a_lo = _bf16_pair(a)
        b_hi, b_lo = _bf16_pair(b)
        out = tl.dot(a_hi, b_hi) + tl.dot(a_lo, b_hi) + tl.dot(a_hi, b_lo)
    return out


@triton.jit
def split_dot32(a, b, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """fp32 a [M, K] times fp32 b [K, N]. SPLIT (16-bit inputs): three bf16 products
    hi hi + lo hi + hi lo (~2^-16 relative, half the tensor-core time of tf32x3); else one
    dot at PREC ("tf32x3" for fp32 inputs)."""
    if SPLIT:
        a_hi, a_lo = _bf16_pair(a)
        b_hi, b_lo = _bf16_pair(b)
        out = tl.dot(a_hi, b_hi) + tl.dot(a_lo, b_hi) + tl.dot(a_hi, b_lo)
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out
