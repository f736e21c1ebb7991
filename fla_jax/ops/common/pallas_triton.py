"""Pieces shared by the Pallas kernels that use the Triton lowering.

- `compiler_params(num_warps, num_stages)`: selects the Triton lowering (the default GPU
  lowering of recent JAX is Mosaic GPU, which cannot run interpreted on CPU).
- `interpret()`: True off-GPU, so every kernel also runs (slowly) on CPU arrays.
- `matmul(a, b, contract)`: fp32-accumulating 2-D matmul; fp32 operands run at IEEE precision
  unless `fla_jax.dtypes.allow_tf32()` was active when the op was traced.
- `split_matmul` / `split_matmul32`: fp32-accurate products of fp32 operands on bf16 tensor
  cores (hi + lo splits), for the fp32 intermediates of 16-bit problems.
- `load_rows` / `store_rows`: a [BT, D] tile at rows `start + arange(BT)` of a [T, D] ref,
  rows >= `n_valid` and columns >= `n_cols` masked (loaded as 0, never stored).
- `split_cumsum`: a cumsum whose pairwise gaps stay fp32-accurate (used by chunk_gates and the
  delta-rule backward).
- `chunk_gates`: chunk-local cumsum of the scalar log-decay (fp32) and the decay matrix.
Shapes use BT = chunk length, D = a padded head size (power of two >= 16).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ... import dtypes
from .dispatch import pallas_interpret


def compiler_params(num_warps: int, num_stages: int):
    """Triton-lowering compiler parameters (works with jax 0.10 and 0.11)."""
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def interpret() -> bool:
    """Run kernels with interpret=True (CPU) when the default backend is not a GPU."""
    return pallas_interpret()


def padded(size: int) -> int:
    """Head size padded to a power of two >= 16 (Triton tiles and dots need it)."""
    return max(16, pl.next_power_of_2(int(size)))


# What 'ieee' fp32 matmuls run as on a GPU: "ieee" (Triton's FMA path, exact fp32 products but
# slow on Hopper) or "tf32x3" (three tf32 tensor-core products, error ~1e-6 relative, the usual
# fp32-accurate tensor-core emulation). Interpreted kernels always use HIGHEST.
GPU_IEEE_ALGORITHM = ["tf32x3"]


def dot_precision():
    """lax precision for in-kernel matmuls: fp32-accurate unless allow_tf32() (then tf32)."""
    if dtypes.fp32_matmul_precision() == "ieee":
        if not interpret() and GPU_IEEE_ALGORITHM[-1] == "tf32x3":
            return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        return lax.Precision.HIGHEST
    return lax.Precision.HIGH


def accurate_precision():
    """lax precision for an in-kernel fp32 matmul that must stay fp32-accurate whatever
    allow_tf32() says (the factored diagonal score blocks): 3xTF32 on the GPU
    (GPU_IEEE_ALGORITHM; Precision.HIGHEST would lower to Triton's slow FMA 'ieee' path),
    HIGHEST interpreted."""
    if not interpret() and GPU_IEEE_ALGORITHM[-1] == "tf32x3":
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.Precision.HIGHEST


def matmul(a, b, contract=(1, 0), precision=lax.Precision.HIGHEST):
    """2-D matmul accumulated in fp32. contract=(1, 0): a @ b; (1, 1): a @ b.T;
    (0, 0): a.T @ b. a and b must share a dtype (cast before the call); `precision` applies
    to fp32 operands only (half-precision operands always multiply exactly on tensor cores)."""
    if a.dtype != jnp.float32:
        precision = None
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def _bf16_pair(x):
    """x (fp32 / fp16) -> (hi, lo) bf16 with hi + lo = x to ~2^-17 relative (fp16: exact)."""
    x = x.astype(jnp.float32)
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _split_products(a, b, contract):
    """a times b on bf16 tensor cores: a bf16 operand as is, any other split into bf16
    hi + lo; the products hi hi + lo hi + hi lo (lo lo, ~2^-16 relative, dropped)."""
    a_hi, a_lo = (a, None) if a.dtype == jnp.bfloat16 else _bf16_pair(a)
    b_hi, b_lo = (b, None) if b.dtype == jnp.bfloat16 else _bf16_pair(b)
    out = matmul(a_hi, b_hi, contract)
    if a_lo is not None:
        out = out + matmul(a_lo, b_hi, contract)
    if b_lo is not None:
        out = out + matmul(a_hi, b_lo, contract)
    return out


def split_matmul(a, b, contract=(1, 0), precision=lax.Precision.HIGHEST):
    """fp32 a times a 16-bit b (or a 16-bit a times an fp32 b) on 16-bit tensor cores,
    fp32-accurate to ~2^-17 (the Triton engine's split_dot_wide): bf16 operand x fp32 one:
    two bf16 products; fp16 operand (split exactly into bf16 too): three. Both fp32: one
    matmul at `precision`. Two / three full-rate bf16 products instead of the three half-rate
    ones of tf32x3."""
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return matmul(a, b, contract, precision)
    return _split_products(a, b, contract)


def split_matmul32(a, b, contract=(1, 0), precision=lax.Precision.HIGHEST, split=True):
    """fp32 a times fp32 b: split (for 16-bit problems) as three bf16 products
    hi hi + lo hi + hi lo (~2^-16 relative, Triton engine's split_dot32); else one matmul at
    `precision` (fp32 problems keep their fp32-accurate precision)."""
    if not split:
        return matmul(a, b, contract, precision)
    return _split_products(a, b, contract)


# A `prec` value for in-kernel fp32 x fp32 products of a 16-bit problem: three full-rate bf16
# products (split_matmul32, ~2^-16 relative per term) instead of tf32x3's three half-rate ones.
SPLIT3 = "bf16x3"


# A `prec` value for the products of a bf16 problem whose operands carry its 2^-8 rounding
# anyway (the DPLR stages' decayed vectors, scores and WY terms, as the Triton DPLR stages of a
# bf16 op): both operands rounded to bf16, one native tensor-core product accumulated in fp32.
BF16 = "bf16x1"


def store_dtype(prec):
    """Storage dtype of an intermediate whose every use is a `prec` product (BF16: bf16,
    the product rounds it anyway; else fp32)."""
    return jnp.bfloat16 if isinstance(prec, str) and prec == BF16 else jnp.float32


def dot(a, b, contract=(1, 0), prec=lax.Precision.HIGHEST):
    """matmul at `prec`; split_matmul32 when prec is SPLIT3; bf16 operands when prec is
    BF16 (accumulated in fp32 either way)."""
    if isinstance(prec, str) and prec == SPLIT3:
        return split_matmul32(a, b, contract)
    if isinstance(prec, str) and prec == BF16:
        return matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), contract)
    return matmul(a, b, contract, prec)


def problem_precision(dtype):
    """The `prec` of a problem whose activations have `dtype`: SPLIT3 for 16-bit problems
    where fp32 products must stay fp32-accurate (dot_precision() not tf32), else
    dot_precision()."""
    prec = dot_precision()
    if jnp.dtype(dtype).itemsize == 2 and prec != lax.Precision.HIGH:
        return SPLIT3
    return prec


# fp32-accurate in-kernel products of 16-bit problems (the factored diagonal score blocks):
# True: split_matmul32 (three full-rate bf16 products, ~2^-16 relative per term); False:
# accurate_precision() (tf32x3 on the GPU). fp32 problems always take accurate_precision().
ACCURATE_SPLIT = [True]


def accurate_matmul(a, b, contract=(1, 0), sixteen_bit=True):
    """fp32 a times fp32 b, fp32-accurate per term: split into bf16 products for 16-bit
    problems (ACCURATE_SPLIT), else at accurate_precision()."""
    if sixteen_bit and ACCURATE_SPLIT[-1]:
        return split_matmul32(a, b, contract)
    return matmul(a, b, contract, accurate_precision())


def _mask(bt, n_valid, width, n_cols, col0):
    """Row mask (None when n_valid is None) & column mask (None when n_cols is None).
    Leaving out a mask the shapes make unnecessary keeps loads vectorised."""
    row = None if n_valid is None else jnp.arange(bt) < n_valid
    if width is None:
        return row
    col = None if n_cols is None else (col0 + jnp.arange(width)) < n_cols
    if row is None and col is None:
        return None
    if row is None:
        return jnp.broadcast_to(col[None, :], (bt, width))
    if col is None:
        return jnp.broadcast_to(row[:, None], (bt, width))
    return row[:, None] & col[None, :]


def load_rows(ref, start, bt, n_valid, n_cols=None, col0=0):
    """ref: [T, D] (or [T]) block. Returns ref[start:start+bt] with rows >= n_valid and
    columns col0 + j >= n_cols read as 0 (None: that mask is not needed)."""
    width = ref.shape[1] if len(ref.shape) == 2 else None
    mask = _mask(bt, n_valid, width, n_cols, col0)
    view = ref.at[pl.ds(start, bt)] if width is None else ref.at[pl.ds(start, bt), :]
    if mask is None:
        return plt.load(view)
    return plt.load(view, mask=mask, other=0.0)


def load_block(ref, r0, rows, n_valid, c0, width, n_cols):
    """ref[r0:r0+rows, c0:c0+width] of a [T, D] ref (columns sliced, unlike load_rows);
    rows >= n_valid and columns c0 + j >= n_cols read as 0."""
    mask = (jnp.arange(rows) < n_valid)[:, None] & ((c0 + jnp.arange(width)) < n_cols)[None, :]
    return plt.load(ref.at[pl.ds(r0, rows), pl.ds(c0, width)], mask=mask, other=0.0)


def store_block(ref, r0, n_valid, c0, n_cols, value):
    """ref[r0:r0+rows, c0:c0+width] = value ([rows, width]), masked like load_block."""
    rows, width = value.shape
    mask = (jnp.arange(rows) < n_valid)[:, None] & ((c0 + jnp.arange(width)) < n_cols)[None, :]
    plt.store(ref.at[pl.ds(r0, rows), pl.ds(c0, width)], value.astype(ref.dtype), mask=mask)


def load_row(ref, t, n_cols, col0=0):
    """Row t of a [T, D] ref as a [D] vector; columns col0 + j >= n_cols read as 0."""
    cols = col0 + jnp.arange(ref.shape[1])
    return plt.load(ref.at[t, :], mask=cols < n_cols, other=0.0)


def store_row(ref, t, value, n_cols, col0=0):
    """ref[t, :] = value ([D]), columns col0 + j >= n_cols not written."""
    cols = col0 + jnp.arange(value.shape[0])
    plt.store(ref.at[t, :], value.astype(ref.dtype), mask=cols < n_cols)


def store_rows(ref, start, n_valid, n_cols, value, col0=0):
    """Store value [BT, D] (or [BT]) into ref[start:start+BT], masked like `load_rows`."""
    bt = value.shape[0]
    width = value.shape[1] if value.ndim == 2 else None
    mask = _mask(bt, n_valid, width, n_cols, col0)
    view = ref.at[pl.ds(start, bt)] if width is None else ref.at[pl.ds(start, bt), :]
    plt.store(view, value.astype(ref.dtype), mask=mask)


def load_tile(ref, n_rows, n_cols, row0=0, col0=0):
    """Whole [R, C] block of a state ref, rows/cols beyond the real sizes read as 0."""
    r, c = ref.shape
    mask = ((row0 + jnp.arange(r)) < n_rows)[:, None] & ((col0 + jnp.arange(c)) < n_cols)[None, :]
    return plt.load(ref, mask=mask, other=0.0)


def store_tile(ref, value, n_rows, n_cols, row0=0, col0=0):
    r, c = ref.shape
    mask = ((row0 + jnp.arange(r)) < n_rows)[:, None] & ((col0 + jnp.arange(c)) < n_cols)[None, :]
    plt.store(ref, value.astype(ref.dtype), mask=mask)


def split_cumsum(x):
    """x [BT] fp32 -> (cumsum [BT], gap [BT, BT] with gap[i, j] = cumsum_i - cumsum_j).

    x = hi + lo with hi on a 2^-8 grid: hi's cumsum is exact in fp32 (|sum| < 2^15) and lo's is
    tiny, so every gap keeps the fp32 accuracy of the gap itself even where the cumsum reaches
    -1000s (strong gates: two plain fp32 cumsums put 2.4e-5 on dg in fp32 on an H100). The
    Triton kernels do the same with an fp64 cumsum (Pallas kernels have no fp64)."""
    hi = jnp.floor(x * 256.0 + 0.5) * (1.0 / 256.0)
    c_hi, c_lo = jnp.cumsum(hi), jnp.cumsum(x - hi)
    gap = (c_hi[:, None] - c_hi[None, :]) + (c_lo[:, None] - c_lo[None, :])
    return c_hi + c_lo, gap


def chunk_gates(g, gamma, n_valid, bt, transposed=False):
    """Chunk-local decay terms, all fp32.

    g: [BT] raw per-token log-decay (0 where masked) or None; gamma: scalar or None.
    Returns gc [BT] (inclusive cumsum of g + gamma over valid rows, flat after them; None
    without any decay), g_last (scalar: gc at the last valid row), D [BT, BT] with
    D[i, j] = exp(gc[i] - gc[j]) for j <= i, else 0 (its transpose when `transposed`), and
    rest [BT] = g_last - gc summed directly over the later rows (a difference of two long
    cumsums loses the few small terms that matter under strong gates: -20 per token costs
    ~1e-4 absolute in the exponent).
    """
    idx = jnp.arange(bt)
    if transposed:
        row, col = idx[None, :], idx[:, None]
    else:
        row, col = idx[:, None], idx[None, :]
    causal = row >= col
    if g is None and gamma is None:
        return None, None, causal.astype(jnp.float32), None
    inc = jnp.zeros((bt,), jnp.float32)
    if g is not None:
        inc = inc + g.astype(jnp.float32)
    if gamma is not None:
        inc = inc + jnp.where(idx < n_valid, gamma, 0.0)
    gc, gap = split_cumsum(inc)
    g_last = jnp.sum(inc)
    if transposed:
        gap = -gap          # gap[j, i] = -gap[i, j], exactly
    diff = jnp.where(causal, gap, 0.0)
    d = jnp.where(causal, jnp.exp(diff), 0.0)
    later = idx[None, :] > idx[:, None]                   # [i, j]: j > i
    rest = jnp.sum(jnp.where(later, inc[None, :], 0.0), axis=1)
    return gc, g_last, d, rest
