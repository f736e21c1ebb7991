"""(I + A)^-1 of a strictly lower triangular [C, C] fp32 matrix by column-wise forward
substitution in lane-level Mosaic GPU code (`plgpu.inline_mgpu`), exact in fp32; whole (block
= C) or on the diagonal blocks of size `block` only (X = the block-diagonal inverse, which the
T0 kernel then completes by recursive doubling, mosaic_kkt.py).

One thread solves one column c of X: with r = e_c, for j = c, c + 1, ..., end - 1: x_jc = r_j,
then r_i += (-A)_ij x_jc for every j < i < end. The dependent chain is one FMA per step; the
updates of a step are independent; column j of -A is row j of the staged -A^T, read by every
thread of the warp at the same address (a broadcast, 16 bytes at a time). X is written over the
staged -A^T: only x_jc with j >= c is stored, in its lower triangle, and the steps read only its
strict upper triangle, so no entry is read after it is written (by any warp); the caller's tile
is masked to the blocks.
block = C: threads 0..31 solve columns 0..31 from row 0, threads 32..63 columns 32..63 from
row 32 (x_jc = 0 for j < c), warps 2 and 3 wait. block = 32: the same threads, each within its
own 32-row block. block = 16: lanes 0..15 of warp w solve the columns of block w.

Interpreted (`gpu_interpret()`) there is no lane-level code: `unit_lower_inverse` solves with
XLA there, so the CPU tests check the data flow around it, and only the GPU proves the solve.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from .tiles import F32, interpreting, iota

WARP = 32
BLOCKS = (64, 32, 16)


def substitute(first: int, end: int, eye, row4, fma, put):
    """The instruction stream of one thread's column c, first <= c < end (unrolled at trace
    time): r_i = eye(i) (1 where i == c) for first <= i < end; for j = first .. end - 1: x_j = r_j
    is put at row j, then r_i = fma((-A)_ij, x_j, r_i) for j < i < end, (-A)_ij read four at a
    time as row4(j, i0) (row j of -A^T, columns i0 .. i0 + 3; end a multiple of 4). The
    lane-level kernel builds MLIR with it; the tests run it on NumPy values."""
    r = {i: eye(i) for i in range(first, end)}
    for j in range(first, end):
        x_j = r.pop(j)
        put(x_j, j)
        for i0 in range((j + 1) // 4 * 4, end, 4):
            four = row4(j, i0)
            for t in range(4):
                if i0 + t > j:
                    r[i0 + t] = fma(four[t], x_j, r[i0 + t])


def lanes_of(C: int, block: int):
    """[(first thread, end thread, first row, end row, column offset)]: which threads solve
    which block (thread t's column: t - first thread + column offset)."""
    if block == C:
        return [(0, WARP, 0, C, 0), (WARP, 2 * WARP, WARP, C, WARP)]
    if block == WARP:
        return [(0, WARP, 0, WARP, 0), (WARP, 2 * WARP, WARP, C, WARP)]
    return [(w * WARP, w * WARP + block, w * block, (w + 1) * block, w * block)
            for w in range(C // block)]


def _lane_solve(C: int, block: int):
    """The inline_mgpu function for [C, C] (C = 64) returning X fp32 (WGMMA layout; entries
    outside the solved lower triangles undefined: the caller masks)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref, vector
    from jaxlib.mlir.dialects import math as mmath

    if C != 2 * WARP or block not in BLOCKS:
        raise ValueError(f"unit_lower_inverse: C={C}, block={block}; the lane-level solve "
                         f"takes C = {2 * WARP} and a block in {BLOCKS}")

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((C, C), F32, layout=plgpu.Layout.WGMMA))
    def solve(ctx, neg_at, na_ref):
        del ctx
        f32 = ir.F32Type.get()
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        quad = ir.VectorType.get([4], f32)
        neg_at.store_untiled(na_ref, optimized=False)      # row j: column j of -A
        mu.warpgroup_barrier()
        tid = arith.remui(mu.thread_idx(), mu.c(4 * WARP, i32))
        zero, one = mu.c(0.0, f32), mu.c(1.0, f32)

        def row4(j, i0):
            four = vector.load(quad, na_ref, [mu.c(j, index), mu.c(i0, index)])
            return [vector.extract(four, dynamic_position=[],
                                   static_position=ir.DenseI64ArrayAttr.get([t]))
                    for t in range(4)]

        for lo, hi, first, end, offset in lanes_of(C, block):
            inside = arith.andi(arith.cmpi(arith.CmpIPredicate.uge, tid, mu.c(lo, i32)),
                                arith.cmpi(arith.CmpIPredicate.ult, tid, mu.c(hi, i32)))
            with mu.when(inside):
                col = arith.addi(arith.subi(tid, mu.c(lo, i32)), mu.c(offset, i32))
                column = arith.index_cast(index, col)

                def eye(i, col=col):
                    return arith.select(arith.cmpi(arith.CmpIPredicate.eq, col, mu.c(i, i32)),
                                        one, zero)

                def put(value, row, col=col, column=column):
                    # x_jc for j < c (zero) is not stored: that entry of -A^T may still be
                    # read (by this warp in this step, by another warp later)
                    with mu.when(arith.cmpi(arith.CmpIPredicate.uge, mu.c(row, i32), col)):
                        memref.store(value, na_ref, [mu.c(row, index), column])

                substitute(first, end, eye, row4, mmath.fma, put)
        mu.warpgroup_barrier()                              # every column written
        x = mgpu.FragmentedArray.load_untiled(na_ref, layout=mgpu.WGMMA_LAYOUT, optimized=False)
        mu.warpgroup_barrier()          # read by every thread: the caller may reuse na_ref
        return x
    return solve


@functools.cache
def _cached(C: int, block: int):
    return _lane_solve(C, block)


def block_mask(C: int, block: int):
    """[C, C] bool (WGMMA layout): the lower triangles of the diagonal block x block blocks."""
    r, c = iota((C, C), 0), iota((C, C), 1)
    same = lax.shift_right_logical(r, block.bit_length() - 1) == lax.shift_right_logical(
        c, block.bit_length() - 1)
    return (r >= c) & same if block < C else r >= c


def unit_lower_inverse(neg_at, na_ref, block: int | None = None):
    """X = (I + A_b)^-1 fp32 [C, C] (WGMMA layout), A_b the part of A in the diagonal
    block x block blocks (block None: C, the whole inverse), from neg_at = -A^T fp32 [C, C]
    (A strictly lower triangular; WGMMA layout). na_ref: plain SMEM fp32 [C, C] scratch (free
    again when this returns)."""
    C = neg_at.shape[0]
    block = block or C
    keep = block_mask(C, block)
    if interpreting():
        a = jnp.where(keep, -neg_at.T, 0.0)
        eye = jnp.eye(C, dtype=F32)
        return jax.scipy.linalg.solve_triangular(eye + a, eye, lower=True, unit_diagonal=True)
    return jnp.where(keep, _cached(C, block)(neg_at, na_ref), 0.0)
