"""Small building blocks of the Mosaic GPU (sm_90) chunk kernels: swizzled SMEM tiles, WGMMA
matmuls with fp32 accumulators, row/column broadcasts and the causal decay matrix.

Layouts: a [M, N] register tile is in the WGMMA layout (M = 64 rows per warpgroup); a
per-row vector is in ROWS (WGMMA reduced over columns), a per-column vector in COLS.
"""
from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import compile_ahead, lowering_cache
from .kernel_cache import keep_hash_stable

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


def union(*groups):
    """SMEM buffers (trees) of disjoint lifetimes sharing memory (plgpu.RefUnion); separate
    buffers under gpu_interpret(), which has no aliasing."""
    if interpreting():
        return tuple(groups)
    return plgpu.RefUnion(*groups)


def matmul(a, b, shape, init=None, ta=False, tb=False):
    """init + op(a) @ op(b), fp32 accumulation on the tensor cores (op: transpose where ta /
    tb). a: SMEM ref or 16-bit register tile (WGMMA layout; ta needs a ref); b: SMEM ref
    (transposes of 16-bit refs only). The result passes an optimization barrier so that no
    arithmetic on it is scheduled before the wgmma wait."""
    if interpreting():    # transposed refs, run_state and register operands do not interpret
        av = a[...] if hasattr(a, "at") else a
        av = av.T if ta else av
        bv = b[...].T if tb else b[...]
        out = jnp.dot(av.astype(F32), bv.astype(F32), precision=lax.Precision.HIGHEST)
        return out if init is None else init + out
    a = a.T if ta else a
    b = b.T if tb else b
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


def matmul_sum(pairs, shape):
    """sum of a @ b over pairs [(a, b), ...] into one fp32 accumulator: the wgmmas are issued
    back to back with a single wait (chained on the accumulator, no round trip per product).
    a: SMEM ref or 16-bit register tile (WGMMA layout); b: SMEM ref."""
    if interpreting():
        out = None
        for a, b in pairs:
            out = matmul(a, b, shape, init=out)
        return out

    def scoped(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]
    return lax.optimization_barrier(pl.run_scoped(scoped, plgpu.ACC(tuple(shape), F32)))


def products_during(ops, between=None):
    """Independent products issued back to back (SMEM or 16-bit register left operands, zero
    accumulators), then `between()` (if given) runs on the warpgroup while the tensor cores
    work, then one wait. ops: (a, b, shape, ta, tb) each, as in `matmul`. Returns (their fp32
    results, between's result or None)."""
    def extra():
        return None if between is None else between()

    if interpreting():
        return (tuple(matmul(a, b, shape, ta=ta, tb=tb) for a, b, shape, ta, tb in ops),
                extra())

    def scoped(*accs):
        for acc, (a, b, _, ta, tb) in zip(accs, ops):
            plgpu.wgmma(acc, a.T if ta else a, b.T if tb else b)
        done = extra()
        return tuple(acc[...] for acc in accs), done

    out = pl.run_scoped(scoped, *(plgpu.ACC(tuple(shape), F32) for _, _, shape, _, _ in ops))
    return lax.optimization_barrier(out)


def matmuls(*ops):
    """Independent products issued together, one wait: each op is (a, b, shape, init, ta, tb)
    as for tiles.matmul (init None: zero). Returns their fp32 results."""
    if interpreting():
        return tuple(matmul(a, b, shape, init=init, ta=ta, tb=tb)
                     for a, b, shape, init, ta, tb in ops)
    inits = tuple(plgpu.ACC.init(zeros_wgmma(shape) if init is None else init)
                  for _, _, shape, init, _, _ in ops)

    def body(accs):
        for acc, (a, b, _, _, ta, tb) in zip(accs, ops):
            plgpu.wgmma(acc, a.T if ta else a, b.T if tb else b)
    return lax.optimization_barrier(pl.run_state(body)(inits))


def iota(shape, dim):
    """int32 [M, N] (WGMMA layout) holding each element's index along dim: the row (or column)
    indices as a vector in ROWS (COLS), broadcast -- the same values as a 2-D iota, which
    Mosaic GPU lowers to index arithmetic per register (~1/8 of some kernels' MLIR, and
    compile time with it)."""
    if interpreting():
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    if dim == 0:
        return rows_of(iota_vec(shape[0], ROWS), shape)
    return cols_of(iota_vec(shape[1], COLS), shape)


def iota_vec(n, layout):
    """0 .. n-1 as a vector in `layout` (ROWS or COLS)."""
    if interpreting():
        return lax.broadcasted_iota(jnp.int32, (n,), 0)
    return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout)


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


# Every kernel under Lane semantics (jax 0.10's default; jax 0.11 defaults to Warpgroup). It
# skips Mosaic's layout inference and dialect lowering, the Python part of a first call: on a
# CPU under jax 0.11.2 the GDN B1 T32768 forward + step lower in 5.5 s instead of 9.3
# (RESULTS.md run 26); H200 (run 27): GPU parity of every Mosaic op 0 failed, first calls
# GLA B4 T4096 18.7 -> 16.3 s, run times unchanged (GLA 0.384 / 1.707 vs 0.388 / 1.704 ms).
# False: each kernel's own choice (`lane=`).
LANE_ALL = True


def compiler_params(approx_math=False, lane=False):
    """approx_math: ex2.approx and friends (~2 ulp of fp32). lane: Lane lowering semantics (SMEM
    buffers keep exactly the transforms given; jax 0.10's default). jax 0.11 defaults to
    Warpgroup semantics, which infers tilings / swizzles for untransformed buffers: row-shifted
    views of them then read permuted columns (GPU run, RESULTS.md run 17). LANE_ALL: Lane for
    every kernel."""
    if lane or LANE_ALL:
        return plgpu.CompilerParams(approx_math=approx_math,
                                    lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.CompilerParams(approx_math=approx_math)


_INTERPRET = [None]


@contextlib.contextmanager
def gpu_interpret():
    """Run the Mosaic GPU kernels built inside on the CPU with JAX's GPU interpret mode
    (simulated SMEM, TMA, barriers and wgmma; slow: tests only). Register layouts do not
    exist there: loads drop them."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    _INTERPRET[0] = InterpretGPUParams()
    try:
        yield
    finally:
        _INTERPRET[0] = None


def interpreting() -> bool:
    return _INTERPRET[0] is not None


def build(body, *, name, out_type, scratch, grid, grid_names, threads=1, approx_math=False,
          lane=False):
    """plgpu.kernel of `threads` warpgroups per CTA (axis "wg" when more than one); lane: see
    compiler_params."""
    kw = dict(num_threads=threads, thread_name="wg") if threads > 1 else {}
    if interpreting():
        return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                            grid_names=grid_names, interpret=_INTERPRET[0], **kw)
    keep_hash_stable(name)     # compiled once per process however often it is lowered,
    compile_ahead.install()    # ... while the rest of the program lowers,
    lowering_cache.install()   # ... and lowered once per process per jaxpr and shapes
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                        grid_names=grid_names, compiler_params=compiler_params(approx_math, lane),
                        kernel_name=name, **kw)


def zeros_wgmma(shape):
    if interpreting():
        return jnp.zeros(shape, F32)
    return plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA)


def load(ref, layout):
    """ref's value in registers of the given layout."""
    if interpreting():
        return ref[...]
    return plgpu.load(ref, (), layout=layout)


def transposed_load_lowers() -> bool:
    """A register load of a swizzled SMEM tile's transpose (`plgpu.load(ref.T, ...)`) lowers
    under jax >= 0.11 (0.10.2: "Can't transpose the swizzled dimension")."""
    if interpreting():
        return True
    major, minor = (int(x) for x in jax.__version__.split(".")[:2])
    return (major, minor) >= (0, 11)


def load_transposed(ref):
    """ref's value transposed, [N, M] for a [M, N] 16-bit swizzled tile, in the WGMMA layout
    (needs transposed_load_lowers())."""
    if interpreting():
        return ref[...].T
    return plgpu.load(ref.T, (), layout=WGMMA)


def load_wgmma(ref):
    return load(ref, WGMMA)


def load_vec(ref, layout):
    return load(ref, layout)


__all__ = ["F32", "LOG2E", "WGMMA", "ROWS", "COLS", "smem_tile", "matmul", "matmul_sum", "matmuls",
           "iota", "rows_of", "cols_of", "causal_decay", "build", "zeros_wgmma", "load_wgmma", "load_vec",
           "jax"]
