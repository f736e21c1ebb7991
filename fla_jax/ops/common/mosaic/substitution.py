"""(I + A)^-1 of a strictly lower triangular [C, C] fp32 matrix by column-wise forward
substitution in lane-level Mosaic GPU code (`plgpu.inline_mgpu`), exact in fp32.

The T0 kernel's default (mosaic_kkt.py) is recursive doubling: ten dependent [C, C] products,
each three bf16 hi / lo wgmmas (~2^-16 relative per product). Here one thread solves one column
c of X = (I + A)^-1 instead: with r = e_c, for j = c, c + 1, ..., C - 1: x_jc = r_j, then
r_i += (-A)_ij x_jc for every i > j. The dependent chain is one FMA per step; the updates of a
step are independent; column j of -A is row j of the staged -A^T, read by every thread of the
warp at the same address (a broadcast, 16 bytes at a time). Threads 0..31 solve columns 0..31
from row 0, threads 32..63 columns 32..63 from row 32 (x_jc = 0 for j < c); warps 2 and 3 wait.

Interpreted (`gpu_interpret()`) there is no lane-level code: `unit_lower_inverse` solves with
XLA there, so the CPU tests check the data flow around it, and only the GPU proves the solve.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from .tiles import F32, interpreting

WARP = 32


def substitute(first: int, C: int, eye, row4, fma, put):
    """The instruction stream of one thread's column c >= first (unrolled at trace time):
    r_i = eye(i) (1 where i == c) for i >= first; rows below `first` are put as None (zero);
    for j = first .. C - 1: x_j = r_j is put at row j, then r_i = fma((-A)_ij, x_j, r_i) for
    i > j, (-A)_ij read four at a time as row4(j, i0) (row j of -A^T, columns i0 .. i0 + 3).
    The lane-level kernel builds MLIR with it; the tests run it on NumPy values."""
    r = {i: eye(i) for i in range(first, C)}
    for i in range(first):
        put(None, i)
    for j in range(first, C):
        x_j = r.pop(j)
        put(x_j, j)
        for i0 in range((j + 1) // 4 * 4, C, 4):
            four = row4(j, i0)
            for t in range(4):
                if i0 + t > j:
                    r[i0 + t] = fma(four[t], x_j, r[i0 + t])


def _lane_solve(C: int, dtype):
    """The inline_mgpu function for [C, C] (C = 64: two warps of columns) returning X in
    `dtype`, WGMMA layout."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref, vector
    from jaxlib.mlir.dialects import math as mmath

    if C != 2 * WARP:
        raise ValueError(f"unit_lower_inverse: C={C}; the lane-level solve takes C = {2 * WARP}")

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((C, C), dtype, layout=plgpu.Layout.WGMMA))
    def solve(ctx, neg_at, na_ref, x_ref):
        del ctx
        f32 = ir.F32Type.get()
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        out_ty = ir.MemRefType(x_ref.type).element_type
        quad = ir.VectorType.get([4], f32)
        neg_at.store_untiled(na_ref, optimized=False)      # row j: column j of -A
        mu.warpgroup_barrier()
        tid = arith.remui(mu.thread_idx(), mu.c(4 * WARP, i32))
        column = arith.index_cast(index, tid)
        zero, one = mu.c(0.0, f32), mu.c(1.0, f32)

        def put(value, row):
            if out_ty != f32:
                value = arith.truncf(out_ty, value)
            memref.store(value, x_ref, [mu.c(row, index), column])

        def eye(i):
            return arith.select(arith.cmpi(arith.CmpIPredicate.eq, tid, mu.c(i, i32)), one, zero)

        def row4(j, i0):
            four = vector.load(quad, na_ref, [mu.c(j, index), mu.c(i0, index)])
            return [vector.extract(four, dynamic_position=[],
                                   static_position=ir.DenseI64ArrayAttr.get([t]))
                    for t in range(4)]

        def columns_from(first: int):
            substitute(first, C, eye, row4, mmath.fma, lambda v, row: put(
                zero if v is None else v, row))

        def lanes(lo: int, hi: int):
            return arith.andi(arith.cmpi(arith.CmpIPredicate.uge, tid, mu.c(lo, i32)),
                              arith.cmpi(arith.CmpIPredicate.ult, tid, mu.c(hi, i32)))

        with mu.when(lanes(0, WARP)):
            columns_from(0)
        with mu.when(lanes(WARP, 2 * WARP)):
            columns_from(WARP)
        mu.warpgroup_barrier()                              # every column written
        return mgpu.FragmentedArray.load_untiled(x_ref, layout=mgpu.WGMMA_LAYOUT,
                                                 optimized=False)
    return solve


@functools.cache
def _cached(C: int, dtype_name: str):
    return _lane_solve(C, jnp.dtype(dtype_name))


def unit_lower_inverse(neg_at, na_ref, x_ref, dtype):
    """X = (I + A)^-1 in `dtype` [C, C] (WGMMA layout) from neg_at = -A^T fp32 [C, C] (A strictly
    lower triangular; WGMMA layout). na_ref: plain SMEM fp32 [C, C]; x_ref: plain SMEM [C, C]
    in `dtype` (both scratch, only touched here)."""
    if interpreting():
        a = -neg_at.T
        eye = jnp.eye(a.shape[0], dtype=F32)
        x = jax.scipy.linalg.solve_triangular(eye + a, eye, lower=True, unit_diagonal=True)
        return x.astype(dtype)
    return _cached(neg_at.shape[0], jnp.dtype(dtype).name)(neg_at, na_ref, x_ref)
