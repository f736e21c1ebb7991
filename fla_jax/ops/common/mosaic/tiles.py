"""Small building blocks of the Mosaic GPU (sm_90) chunk kernels: swizzled SMEM tiles, WGMMA
matmuls with fp32 accumulators, row/column broadcasts and the causal decay matrix.

Layouts: a [M, N] register tile is in the WGMMA layout (M = 64 rows per warpgroup); a
per-row vector is in ROWS (WGMMA reduced over columns), a per-column vector in COLS.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
LOG2E = math.log2(math.e)
WGMMA = plgpu.Layout.WGMMA
ROWS = plgpu.Layout.WGMMA.reduce(1)
COLS = plgpu.Layout.WGMMA.reduce(0)


def smem_tile(shape, dtype):
    """SMEM buffer tiled and swizzled for TMA copies and WGMMA operands (minor dim last)."""
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    return plgpu.SMEM(tuple(shape), dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle)))


def matmul(a, b, shape, init=None):
    """init + a @ b, fp32 accumulation on the tensor cores. a: SMEM ref or 16-bit register
    tile (WGMMA layout); b: SMEM ref (`.T` views allowed for 16-bit). The result passes an
    optimization barrier so that no arithmetic on it is scheduled before the wgmma wait."""
    if init is None:
        def scoped(acc):
            plgpu.wgmma(acc, a, b)
            return acc[...]
        out = pl.run_scoped(scoped, plgpu.ACC(tuple(shape), F32))
    else:
        def body(acc):
            plgpu.wgmma(acc, a, b)
        out = pl.run_state(body)(plgpu.ACC.init(init))
    return lax.optimization_barrier(out)


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def rows_of(vec, shape):
    """vec[i] along row i (vec in ROWS)."""
    return lax.broadcast_in_dim(vec, shape, [0])


def cols_of(vec, shape):
    """vec[j] along column j (vec in COLS)."""
    return lax.broadcast_in_dim(vec, shape, [1])


def causal_decay(g_row, g_col, shape, transposed=False):
    """exp2(g_i - g_j) for j <= i, 0 elsewhere ([i, j]); transposed: the [j, i] tile
    (g_row indexes j, g_col indexes i, kept where i >= j). The exponent is masked before exp2."""
    r, c = iota(shape, 0), iota(shape, 1)
    if transposed:
        keep = c >= r
        expo = cols_of(g_col, shape) - rows_of(g_row, shape)
    else:
        keep = r >= c
        expo = rows_of(g_row, shape) - cols_of(g_col, shape)
    return jnp.exp2(jnp.where(keep, expo, -jnp.inf))


def compiler_params():
    return plgpu.CompilerParams(approx_math=False)


def build(body, *, name, out_type, scratch, grid, grid_names):
    """plgpu.kernel of one warpgroup per CTA."""
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                        grid_names=grid_names, compiler_params=compiler_params(),
                        kernel_name=name)


def zeros_wgmma(shape):
    return plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA)


def load_wgmma(ref):
    return plgpu.load(ref, (), layout=WGMMA)


def load_vec(ref, layout):
    return plgpu.load(ref, (), layout=layout)


__all__ = ["F32", "LOG2E", "WGMMA", "ROWS", "COLS", "smem_tile", "matmul", "iota", "rows_of",
           "cols_of", "causal_decay", "build", "zeros_wgmma", "load_wgmma", "load_vec", "jax"]
