"""Pieces shared by the Triton kernels of scalar-gated recurrences (simple GLA; later GDN).

- `dot_precision(dtype)`: the `input_precision` every `tl.dot` of a kernel gets: fp32 operands
  are multiplied fp32-accurately ("tf32x3": three tf32 tensor-core products, the same scheme as
  XLA's HIGHEST precision that the Pallas kernels use) unless `fla_torch.dtypes.allow_tf32()` is
  active; 16-bit operands ignore it. Triton's "ieee" (CUDA-core FMA) is never used: on Hopper it
  is ~15x slower and spills registers (measured 366 ms vs 1.2 ms for a bf16 backward).
- `block(size, cap)`: a power-of-two tile >= 16 covering `size` (masked beyond it).
- In-kernel helpers `chunk_log_decay`, `causal_decay`, `suffix_sum`, `prefix_sum_excl`
  (sequence bounds and chunk slots: engine/varlen.py).
- dg of a scalar gate in the recurrent kernels: dG_t = q_t.dq_t - k_t.dk_t per token, reverse
  cumsum per sequence by the shared `common/triton_gate_grad.sequence_reverse_cumsum`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import dtypes


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` for dots on operands of `dtype`: fp32 -> 'tf32x3' (fp32-accurate), or
    'tf32' inside `fla_torch.dtypes.allow_tf32()`; 16-bit -> 'tf32' (ignored by Triton)."""
    if dtype == torch.float32:
        return fp32_dot_precision()
    return "tf32"


def fp32_dot_precision() -> str:
    """`input_precision` for dots on fp32 operands, also the fp32 internals of a kernel whose
    inputs are 16-bit: 'tf32x3' (fp32-accurate) unless `allow_tf32()` is active."""
    return "tf32" if dtypes.fp32_matmul_precision() == "tf32" else "tf32x3"


def block(size: int, cap: int = 256) -> int:
    """Smallest power of two >= max(size, 16), at most `cap` (callers tile beyond it)."""
    return min(max(16, triton.next_power_of_2(size)), cap)


@triton.jit
def chunk_log_decay(g, gamma, row, m_t, USE_G: tl.constexpr, USE_GAMMA: tl.constexpr,
                    BT: tl.constexpr):
    """Cumulative log-decay inside one chunk, kept accurate for differences.

    row: [BT] flat indices (token * H + head) into g [B*T, H]; m_t: valid tokens (padded
    tokens add nothing). The cumsum b is taken in fp64 and split into fp32 b (rounded) + b_lo
    (the rest), so a gap b_i - b_j is (b_i - b_j) + (b_lo_i - b_lo_j) to fp32 accuracy of the
    gap itself even when |b| is large (strong gates: b reaches -1000s inside a chunk, where a
    plain fp32 cumsum would put ~1e-4 relative error on exp(b_i - b_j)).
    Returns b [BT], b_lo [BT], to_end [BT] = b_last - b_j (accurate), b_last (scalar), fp32.
    """
    gt = tl.zeros([BT], dtype=tl.float64)
    if USE_G:
        gt += tl.load(g + row, mask=m_t, other=0.).to(tl.float64)
    if USE_GAMMA:
        gt += tl.where(m_t, gamma, 0.).to(tl.float64)
    b64 = tl.cumsum(gt, axis=0)
    b = b64.to(tl.float32)
    b_lo = (b64 - b.to(tl.float64)).to(tl.float32)
    last64 = tl.sum(gt, axis=0)
    b_last = last64.to(tl.float32)
    last_lo = (last64 - b_last.to(tl.float64)).to(tl.float32)
    to_end = (b_last - b) + (last_lo - b_lo)
    return b, b_lo, to_end, b_last


@triton.jit
def causal_decay(A, b, b_lo, causal, HAS_DECAY: tl.constexpr):
    """A[i, j] * exp(b_i - b_j) where i >= j, else 0 (see chunk_log_decay for b, b_lo)."""
    if HAS_DECAY:
        gap = (b[:, None] - b[None, :]) + (b_lo[:, None] - b_lo[None, :])
        A = A * tl.exp(tl.where(causal, gap, 0.))
    return tl.where(causal, A, 0.)


@triton.jit
def suffix_sum(x, o_t):
    """y_t = sum_{s >= t} x_s of a [BT] vector as a masked [BT, BT] row sum (o_t = arange).
    Unlike `total - cumsum + x` it carries no rounding of terms outside the suffix: under
    strong gates a chunk's gate-gradient terms differ by orders of magnitude and the small
    sums at most rows must not inherit the rounding of the O(1) ones."""
    return tl.sum(tl.where(o_t[None, :] >= o_t[:, None], x[None, :], 0.0), axis=1)


@triton.jit
def prefix_sum_excl(x, o_t):
    """y_t = sum_{s < t} x_s of a [BT] vector (masked row sum, see `suffix_sum`)."""
    return tl.sum(tl.where(o_t[None, :] < o_t[:, None], x[None, :], 0.0), axis=1)
