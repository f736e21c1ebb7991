"""(I + A)^-1 of a strictly lower triangular [C, C] fp32 matrix by column-wise forward
substitution in lane-level Mosaic GPU code (`plgpu.inline_mgpu`), exact in fp32; whole (block
= C) or on the diagonal blocks of size `block` only (X = the block-diagonal inverse, which the
T0 kernel then completes by recursive doubling, mosaic_kkt.py).

One thread solves one column c of X: with r = e_c, for j = first, ..., end - 1: x_jc = r_j,
then r_i += (-A)_ij x_jc for every j < i < end. The dependent chain is one FMA per step; the
updates of a step are independent; column j of -A is row j of the staged -A^T, read by every
thread of the warp at the same address (a broadcast, 16 bytes at a time). The loop only reads
(-A^T's buffer) and keeps x_jc in registers (each r_j becomes x_jc: no more live values); X is
written afterwards, every x_jc of the solved rows unconditionally (x_jc = 0 exactly for j < c),
to a second buffer zero-filled beforehand: no store or branch between the row loads of the
chain, and the tile comes back with zeros outside the solved blocks (no mask).
Threads: thread t < C solves column t. block < C: rows of its block, first = t - t % block
(block = 16: two blocks per warp, one code path with the block's first row computed per lane);
block = C: threads 0..31 from row 0, threads 32..63 from row 32 (x_jc = 0 for j < c).
Both fp32 buffers have rows padded to C + PAD floats: the WGMMA layout stores and loads 8 rows
per warp instruction, at a 256-byte row stride all in the same banks. CTAs of odd block index
sum solve on warps 2 and 3 (threads 64..127), so that two CTAs resident on an SM do not both
solve on the same two warp schedulers.

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
PAD = 8     # floats added to each row of the fp32 buffers (bank conflicts: module docstring)


def substitute(n: int, eye, row4, fma):
    """The instruction stream of one thread's column (unrolled at trace time), rows relative to
    the first row it solves: r_i = eye(i) (1 at the column's own row) for 0 <= i < n; for
    j = 0 .. n - 1: x_j = r_j, then r_i = fma((-A)_ij, x_j, r_i) for j < i < n, (-A)_ij read
    four at a time as row4(j, i0) (row j of -A^T, columns i0 .. i0 + 3; n a multiple of 4).
    Returns [x_0, ..., x_{n-1}]. The lane-level kernel builds MLIR with it; the tests run it
    on NumPy values."""
    r = {i: eye(i) for i in range(n)}
    x = []
    for j in range(n):
        x.append(r.pop(j))
        for i0 in range((j + 1) // 4 * 4, n, 4):
            four = row4(j, i0)
            for t in range(4):
                if i0 + t > j:
                    r[i0 + t] = fma(four[t], x[j], r[i0 + t])
    return x


def lanes_of(C: int, block: int):
    """[(first thread, end thread, rows n, first row or None)]: thread t of [first, end)
    solves column t over rows first row .. first row + n - 1; None: the rows of t's own block,
    from t - t % block (n = block)."""
    if block == C:
        return [(0, WARP, C, 0), (WARP, 2 * WARP, C - WARP, WARP)]
    return [(0, C, block, None)]


def _lane_solve(C: int, block: int):
    """The inline_mgpu function (-A^T in registers, padded fp32 buffers for -A^T and X) for
    [C, C] (C = 64) returning X fp32 (WGMMA layout, zero outside the solved blocks)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, memref, vector
    from jaxlib.mlir.dialects import math as mmath

    if C != 2 * WARP or block not in BLOCKS:
        raise ValueError(f"unit_lower_inverse: C={C}, block={block}; the lane-level solve "
                         f"takes C = {2 * WARP} and a block in {BLOCKS}")

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((C, C), F32, layout=plgpu.Layout.WGMMA))
    def solve(ctx, neg_at, na_ref, x_ref):
        del ctx
        f32 = ir.F32Type.get()
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        quad = ir.VectorType.get([4], f32)
        zero, one = mu.c(0.0, f32), mu.c(1.0, f32)
        neg_at.store_untiled(na_ref, optimized=False)      # row j: column j of -A
        mgpu.FragmentedArray.splat(zero, (C, C), layout=mgpu.WGMMA_LAYOUT).store_untiled(
            x_ref, optimized=False)
        mu.warpgroup_barrier()
        # odd CTAs (block index sum) solve on threads 64..127: warps 2 and 3
        bsum = arith.addi(arith.addi(gpu.block_id(gpu.Dimension.x),
                                     gpu.block_id(gpu.Dimension.y)),
                          gpu.block_id(gpu.Dimension.z))
        shift = arith.muli(arith.index_cast(i32, arith.remui(bsum, mu.c(2, index))),
                           mu.c(2 * WARP, i32))
        tid = arith.remui(arith.addi(mu.thread_idx(), shift), mu.c(4 * WARP, i32))

        for lo, hi, n, first in lanes_of(C, block):
            inside = arith.andi(arith.cmpi(arith.CmpIPredicate.uge, tid, mu.c(lo, i32)),
                                arith.cmpi(arith.CmpIPredicate.ult, tid, mu.c(hi, i32)))
            with mu.when(inside):
                column = arith.index_cast(index, tid)
                if first is None:      # the first row of this thread's block
                    own = arith.remui(tid, mu.c(n, i32))
                    row0 = arith.index_cast(index, arith.subi(tid, own))
                else:
                    own = arith.subi(tid, mu.c(first, i32))
                    row0 = mu.c(first, index)

                def at(i, row0=row0):
                    return arith.addi(row0, mu.c(i, index))

                def eye(i, own=own):
                    return arith.select(arith.cmpi(arith.CmpIPredicate.eq, own, mu.c(i, i32)),
                                        one, zero)

                def row4(j, i0, at=at):
                    four = vector.load(quad, na_ref, [at(j), at(i0)])
                    return [vector.extract(four, dynamic_position=[],
                                           static_position=ir.DenseI64ArrayAttr.get([t]))
                            for t in range(4)]

                for j, x_j in enumerate(substitute(n, eye, row4, mmath.fma)):
                    memref.store(x_j, x_ref, [at(j), column])
        mu.warpgroup_barrier()                              # every column written
        x = mgpu.FragmentedArray.load_untiled(x_ref, layout=mgpu.WGMMA_LAYOUT, optimized=False)
        mu.warpgroup_barrier()          # read by every thread: the caller may reuse the buffers
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


def scratch(C: int):
    """The two padded fp32 SMEM buffers unit_lower_inverse takes (-A^T, X)."""
    return plgpu.SMEM((C, C + PAD), F32), plgpu.SMEM((C, C + PAD), F32)


def unit_lower_inverse(neg_at, bufs, block: int | None = None):
    """X = (I + A_b)^-1 fp32 [C, C] (WGMMA layout), A_b the part of A in the diagonal
    block x block blocks (block None: C, the whole inverse), from neg_at = -A^T fp32 [C, C]
    (A strictly lower triangular; WGMMA layout). bufs: the two SMEM buffers of `scratch(C)`
    (free again when this returns)."""
    C = neg_at.shape[0]
    block = block or C
    if interpreting():
        a = jnp.where(block_mask(C, block), -neg_at.T, 0.0)
        eye = jnp.eye(C, dtype=F32)
        return jax.scipy.linalg.solve_triangular(eye + a, eye, lower=True, unit_diagonal=True)
    na, xs = bufs
    return _cached(C, block)(neg_at, na.at[:, :C], xs.at[:, :C])
