"""Small Mosaic GPU (sm_90) building blocks of the delta-rule kernels.

Register tiles use the WGMMA layout of one warpgroup; a per-token vector that scales the
rows of a tile is loaded in the `ROWS` layout, one that scales its columns in `COLS`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
CHUNK = 64
WGMMA = plgpu.Layout.WGMMA
ROWS = plgpu.Layout.WGMMA.reduce(1)   # one value per row of a [M, N] WGMMA tile
COLS = plgpu.Layout.WGMMA.reduce(0)   # one value per column


def swizzled(shape, dtype) -> plgpu.SMEM:
    """SMEM buffer whose last dim is tiled and swizzled for TMA and wgmma operands."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


INTERPRET = [False]   # set by tests that run the kernels in Pallas' GPU interpret mode


class _Transposed:
    def __init__(self, ref):
        self.ref = ref

    def __getitem__(self, idx):
        return self.ref[...].T


def tr(ref):
    """ref.T (a transposed view for wgmma operands)."""
    return _Transposed(ref) if INTERPRET[0] else ref.T


def zeros(shape):
    """fp32 zeros in the WGMMA layout."""
    if INTERPRET[0]:
        return jnp.zeros(shape, F32)
    return plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA)


def load(ref, layout, optimized=True):
    """ref[...] into registers in `layout` (plain ref[...] under the GPU interpreter)."""
    if INTERPRET[0]:
        return ref[...]
    return plgpu.load(ref, (), layout=layout, optimized=optimized)


def iota(shape, dim):
    if INTERPRET[0]:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def by_rows(vec, shape):
    """vec [M] (ROWS layout) broadcast over the columns of an [M, N] tile."""
    return lax.broadcast_in_dim(vec, shape, [0])


def by_cols(vec, shape):
    """vec [N] (COLS layout) broadcast over the rows of an [M, N] tile."""
    return lax.broadcast_in_dim(vec, shape, [1])


def causal_decay(g_row, g_col, n: int):
    """[n, n] fp32: exp(G_i - G_j) where j <= i, else 0 (the exponent is masked first, so
    the acausal part never overflows)."""
    shape = (n, n)
    keep = iota(shape, 0) >= iota(shape, 1)
    return jnp.exp(jnp.where(keep, by_rows(g_row, shape) - by_cols(g_col, shape), -jnp.inf))


def mma(a, b, shape, init=None):
    """init + a @ b on the tensor cores, fp32 accumulator [M, N]. a: SMEM ref or 16-bit
    registers (WGMMA layout); b: SMEM ref (`.T` views allowed). The optimisation barrier
    keeps reads of the result after the wgmma wait."""
    if INTERPRET[0]:
        return _reference_mma(a, b, init)
    if init is None:
        def scoped(acc):
            plgpu.wgmma(acc, a, b)
            return acc[...]
        out = pl.run_scoped(scoped, plgpu.ACC(shape, F32))
    else:
        def body(acc):
            plgpu.wgmma(acc, a, b)
        out = pl.run_state(body)(plgpu.ACC.init(init))
    return lax.optimization_barrier(out)


def mma2(a1, b1, a2, b2, shape):
    """a1 @ b1 + a2 @ b2 in one fp32 accumulator [M, N] (operands as for `mma`)."""
    if INTERPRET[0]:
        return _reference_mma(a2, b2, _reference_mma(a1, b1, None))
    def scoped(acc):
        plgpu.wgmma(acc, a1, b1)
        plgpu.wgmma(acc, a2, b2)
        return acc[...]
    return lax.optimization_barrier(pl.run_scoped(scoped, plgpu.ACC(shape, F32)))


def _reference_mma(a, b, init):
    """`mma` for the GPU interpreter: a plain dot with fp32 accumulation."""
    a = a if isinstance(a, jax.Array) else a[...]
    out = jnp.dot(a, b[...], preferred_element_type=F32)
    return out if init is None else init + out
