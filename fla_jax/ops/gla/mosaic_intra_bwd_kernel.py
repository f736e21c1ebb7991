"""Mosaic GPU (sm_90) chunk-parallel part of the GLA backward: per chunk of C = 64 rows and
head, with b the chunk-local log2 cumsum of g (recomputed: mosaic_intra_kernel.chunk_cumsum),
dA = scale tril(do v^T) (the lower triangle of scale do v^T) and the state terms
dqg = scale do S_n^T, dkg = v dS_{n+1}^T:
    dq_i = dqg_i 2^{b_i} + sum_{j <= i} dA_ij k_j 2^{b_i - b_j}
    dk_j = dkg_j 2^{last - b_j} + sum_{i >= j} dA_ij q_i 2^{b_i - b_j}
    r1 = q dq - k dk_intra,   r2 = k dk_inter       (fp32, per row and channel; the pairs
                                                     (i, i) left out of r1: they cancel)
    dg_t = sum_{s >= t} r1_s + sum_{s < t} r2_s + dstate        (two scans within the chunk,
                                                     never a chunk total minus a prefix)

The intra-chunk sums are split as in the forward (mosaic_intra_kernel.py), every factor <= 1:
- sub-chunk blocks I > J on the tensor cores through e_J = b at the last row of block J:
  dq_I += (dA_IJ @ k_J 2^{e_J - b_J}) 2^{b_I - e_J},  dk_J += (dA_IJ^T @ q_I 2^{b_I - e_J})
  2^{e_J - b_J};
- the lower-left 8 x 8 quadrant of each diagonal 16 x 16 block likewise through m = b at the
  block's row 8 (one product each for dq and dk; in a bounded part, mosaic_intra_kernel.FAST,
  the whole strict lower triangle of the diagonal blocks through the same middle row, and no
  exact loop below);
- the diagonal 8 x 8 blocks exactly in fp32: for offsets d = 1..7 on row i the coefficient
  dA_{i,i-d} and key row i - d (dq), on row j the coefficient dA_{j+d,j} and query row j + d
  (dk; those coefficients gathered once per chunk), the partner rows read row-shifted, the
  decays running products of exp(g).
One CTA (one warpgroup) per (chunk, head); key columns in parts of P (TMA loads per part, dA
once per chunk). Lane lowering semantics (row-shifted buffers). Shared memory kept under half
of the SM's (~107 KB: dA's fp32 copy shares memory with the inputs, the outputs are written
over q, k and g, exp(g) lives in the scan buffer between the scans, one scan buffer, two
product operands at a time) so that two CTAs run on each SM.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.tiles import (COLS, F32, LOG2E, WGMMA, build, cols_of, iota, load,
                                   matmuls, rows_of, smem_tile, union, zeros_wgmma)
from .mosaic_intra_kernel import (C, EXACT, NSUB, P, PAD_SCAN, PITCH, SUB, and_exact,
                                  bounded_part, chunk_cumsum, or_bounded, per_block, pick,
                                  scan_buffer, scan_row_of, shift_down, zero_scan_pads)

PAD_ABOVE = EXACT   # zero rows next to the row-shifted k and q (shifts up to EXACT - 1)
PAD = EXACT         # padding of dA's columns (read row-shifted down to row C + EXACT - 1)


def _as_parts(shape, dtype):
    """SMEM tiled and swizzled like a [C, P] part (wgmma wants both operands' swizzles equal):
    a [C, C] left operand next to [C, P] right ones."""
    sw = P * jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, P)),
                                                plgpu.SwizzleTransform(sw)))


def gla_intra_bwd(q_rows, k_rows, g_rows, da, dqg, dkg, dstate):
    """q_rows, k_rows: [R, H, K] (one 16-bit dtype; chunks of C consecutive rows); g_rows:
    [R, H, K] fp32 log-decay (natural log); da: [NC, H, C, C + 8] fp32 (scale do v^T per
    chunk, columns C.. padding; only its lower triangle is read); dqg: [NC, H, C, K] fp32;
    dkg: [NC, H, C, K] fp32; dstate: [H, NC, K] fp32
    (the state decay's gate term, el (S_n . dS_{n+1}), on every row of chunk n), NC = R // C.
    Returns dq, dk [R, H, K] in q's dtype and dg [R, H, K] fp32 (see the module docstring)."""
    R, H, K = q_rows.shape
    dtype = q_rows.dtype
    NC = R // C
    if R % C or K % P or k_rows.shape != (R, H, K) or g_rows.shape != (R, H, K) \
            or da.shape != (NC, H, C, C + EXACT) or dqg.shape != (NC, H, C, K) \
            or dkg.shape != (NC, H, C, K) or dstate.shape != (H, NC, K):
        raise ValueError(f"gla_intra_bwd: q_rows {q_rows.shape}, k_rows {k_rows.shape}, g_rows "
                         f"{g_rows.shape}, da {da.shape}, dqg {dqg.shape}, dkg {dkg.shape}, "
                         f"dstate {dstate.shape}; expected q/k/g [R, H, K] (R % {C} == 0, "
                         f"K % {P} == 0), da [R // {C}, H, {C}, {C + EXACT}], dqg "
                         f"[R // {C}, H, {C}, K], dkg [R // {C}, H, {C}, K], dstate "
                         f"[H, R // {C}, K]")
    parts = K // P
    tile, sq, blk16 = (C, P), (C, C), (C, SUB)
    scratch = dict(
        # q, k, g (dq, dk, dg are written back over them), dqg, dkg, dstate; before the first
        # part, sharing their memory, dA [C + EXACT, C + EXACT] fp32 (untiled, the pitch
        # padded: read row-shifted in 16-column blocks; the rows below C zero)
        ins_da=union((smem_tile(tile, dtype), smem_tile(tile, dtype), smem_tile(tile, F32),
                      smem_tile(tile, F32), smem_tile(tile, F32), plgpu.SMEM((P,), F32)),
                     plgpu.SMEM((C + EXACT, C + EXACT), F32)),
        # dA in 16 bits: per J < 3 its column block J on the rows below it; on the diagonal
        # blocks' strict lower triangles
        lhs_s=tuple(_as_parts(sq, dtype) for _ in range(NSUB - 1)), daq16=_as_parts(sq, dtype),
        kpad=plgpu.SMEM((PAD_ABOVE + C, PITCH), dtype),     # k, zero rows above
        qpad=plgpu.SMEM((C + PAD_ABOVE, PITCH), dtype),     # q, zero rows below
        # the scans; between them its data rows hold exp(g) (its zero rows around them)
        spad=scan_buffer(reverse=True, buffers=1),
        ops=(smem_tile(tile, dtype), smem_tile(tile, dtype)),   # the products' right operands
        bar=plgpu.Barrier(num_arrivals=6), da_bar=plgpu.Barrier(num_arrivals=1),
    )
    out_type = (jax.ShapeDtypeStruct((R, H, K), dtype), jax.ShapeDtypeStruct((R, H, K), dtype),
                jax.ShapeDtypeStruct((R, H, K), F32))

    def body(q_ref, k_ref, g_ref, da_ref, dqg_ref, dkg_ref, dst_ref, dq_ref, dk_ref, dg_ref,
             *, ins_da, lhs_s, daq16, kpad, qpad, spad, ops, bar, da_bar):
        ins, da_s = ins_da
        q_s, k_s, g_s, dqg_s, dkg_s, dst_s = ins
        n, h = lax.axis_index("n"), lax.axis_index("h")
        rows = pl.ds(n * C, C)
        data = pl.ds(0, P)
        r16 = lax.bitwise_and(iota(blk16, 0), SUB - 1)
        c16 = iota(blk16, 1)
        rb = lax.shift_right_logical(iota(blk16, 0), 4)
        blocks = lax.shift_right_logical(iota(tile, 0), 4)
        second = lax.bitwise_and(iota(tile, 0), SUB - 1) >= EXACT
        zero_scan_pads(spad)
        # the shifted buffers' rows around the data stay zero: the masked rows' terms (a zero
        # coefficient times a product through them) stay finite
        kpad.at[pl.ds(0, C), data][...] = zeros_wgmma(tile).astype(dtype)
        qpad.at[pl.ds(PAD_ABOVE, C), data][...] = zeros_wgmma(tile).astype(dtype)
        da_s.at[pl.ds(EXACT, C), pl.ds(0, C)][...] = zeros_wgmma(sq)   # rows C.. stay zero
        plgpu.commit_smem()

        # dA, once per chunk: fp32 (exact diagonal blocks), 16-bit copies for the products
        plgpu.copy_gmem_to_smem(da_ref.at[n, h], da_s.at[pl.ds(0, C)], da_bar)
        plgpu.barrier_wait(da_bar)
        full = load(da_s.at[pl.ds(0, C), pl.ds(0, C)], WGMMA)
        r, c = iota(sq, 0), iota(sq, 1)
        # the strict lower triangle of each diagonal 16 x 16 block: a bounded part reads all
        # of it; otherwise the operands' and results' masks keep its lower-left 8 x 8 quadrant
        quad = (lax.shift_right_logical(r, 4) == lax.shift_right_logical(c, 4)) & (r > c)
        for j in range(NSUB - 1):
            below = (lax.shift_right_logical(r, 4) > j) & (lax.shift_right_logical(c, 4) == j)
            lhs_s[j][...] = jnp.where(below, full, 0.0).astype(dtype)
        daq16[...] = jnp.where(quad, full, 0.0).astype(dtype)

        def diag_rows(d):
            """T[j, c] = dA[j + d, 16 (j // 16) + c]: row j's diagonal block, d rows down."""
            out = zeros_wgmma(blk16)
            for j in range(NSUB):
                blk = load(da_s.at[pl.ds(d, C), pl.ds(SUB * j, SUB)], WGMMA)
                out = jnp.where(rb == j, blk, out)
            return out

        diag_blk = diag_rows(0)             # [i, c]: dA[i, 16 (i // 16) + c]
        diag_t = zeros_wgmma(blk16)         # [j, d]: dA[j + d, j] (both rows in one 8-block)
        for d in range(1, EXACT):
            coef = jnp.sum(jnp.where(c16 == r16, diag_rows(d), 0.0), axis=1)
            keep = (c16 == d) & (lax.bitwise_and(r16, EXACT - 1) + d < EXACT)
            diag_t = jnp.where(keep, rows_of(coef, blk16), diag_t)
        plgpu.commit_smem()

        def part(p, carry):
            cols = pl.ds(pl.multiple_of(p * P, P), P)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous part's stores
            plgpu.commit_smem()
            for src, dst in ((q_ref, q_s), (k_ref, k_s), (g_ref, g_s)):
                plgpu.copy_gmem_to_smem(src.at[rows, h, cols], dst, bar)
            for src, dst in ((dqg_ref, dqg_s), (dkg_ref, dkg_s)):
                plgpu.copy_gmem_to_smem(src.at[n, h, pl.ds(0, C), cols], dst, bar)
            plgpu.copy_gmem_to_smem(dst_ref.at[h, n, cols], dst_s, bar)
            plgpu.barrier_wait(bar)
            x = load(g_s, WGMMA) * LOG2E
            kpad.at[pl.ds(PAD_ABOVE, C), data][...] = load(k_s, WGMMA)
            qpad.at[pl.ds(0, C), data][...] = load(q_s, WGMMA)
            b = chunk_cumsum(spad, x)
            ends = [scan_row_of(spad, SUB * j + SUB - 1)[0] for j in range(NSUB)]
            mids = [scan_row_of(spad, SUB * j + EXACT - 1)[0] for j in range(NSUB)]
            mid = per_block(blocks, mids, tile)
            fast = bounded_part(b, mid, dtype)     # no exact 8 x 8 loop (mosaic_intra_kernel)
            plgpu.commit_smem()                    # every thread has read b's rows
            spad.at[0, pl.ds(PAD_SCAN, C), data][...] = jnp.exp2(x)
            plgpu.commit_smem()

            # the diagonal 8 x 8 blocks, exact: for offset d, on row i the pair (i, i - d)
            # (dq: coefficient dA[i, i - d], key row i - d, decay 2^(b_i - b_{i-d})) and on row
            # j the pair (j + d, j) (dk: dA[j + d, j], query row j + d, 2^(b_{j+d} - b_j)),
            # the decays running products of exp(g) read row-shifted. The pair (i, i) has no
            # decay: its terms q dA_ii k cancel exactly in r1, so they enter dq and dk only
            # after r1 is formed (under strong gates they dominate both)
            def offset(d, cr):
                dec, dec_t, dq, dk_x = cr
                dec = dec * load(spad.at[0, pl.ds(PAD_SCAN + 1 - d, C), data], WGMMA)
                dec_t = dec_t * load(spad.at[0, pl.ds(PAD_SCAN + d, C), data], WGMMA)
                kd = load(kpad.at[pl.ds(PAD_ABOVE - d, C), data], WGMMA).astype(F32)
                qd = load(qpad.at[pl.ds(d, C), data], WGMMA).astype(F32)
                keep = (c16 == r16 - d) & (lax.bitwise_and(r16, EXACT - 1) >= d)
                coef = rows_of(jnp.sum(jnp.where(keep, diag_blk, 0.0), axis=1), tile)
                coef_t = rows_of(jnp.sum(jnp.where(c16 == d, diag_t, 0.0), axis=1), tile)
                return dec, dec_t, dq + coef * kd * dec, dk_x + coef_t * qd * dec_t

            one = zeros_wgmma(tile) + 1.0
            _, _, dq, dk_x = lax.fori_loop(1, pick(fast, 1, EXACT), offset,
                                           (one, one, zeros_wgmma(tile), zeros_wgmma(tile)))

            # the tensor-core products (16-bit operands, every factor <= 1), two operands in
            # SMEM at a time: dq's (blocks below the diagonal ones through e_J, quadrants
            # through m_J), then dk's in two rounds
            q = load(q_s, WGMMA).astype(F32)
            k = load(k_s, WGMMA).astype(F32)
            end = per_block(blocks, ends, tile)
            x_s, x2_s = ops
            x_s[...] = (k * jnp.exp2(jnp.where(blocks < NSUB - 1, end - b, -jnp.inf))
                        ).astype(dtype)
            x2_s[...] = (k * jnp.exp2(jnp.where(and_exact(second, fast), -jnp.inf, mid - b))
                         ).astype(dtype)
            plgpu.commit_smem()
            prods = [(lhs_s[j], x_s, tile, None, False, False) for j in range(NSUB - 1)]
            prods.append((daq16, x2_s, tile, None, False, False))
            res = matmuls(*prods)
            for j in range(NSUB - 1):
                dq = dq + res[j] * jnp.exp2(jnp.where(blocks > j, b - cols_of(ends[j], tile),
                                                      -jnp.inf))
            dq = dq + res[-1] * jnp.exp2(jnp.where(or_bounded(second, fast), b - mid,
                                                   -jnp.inf))
            # dk's left operands: q_I 2^(b_I - e_J) per J < 3, q 2^(b - m) on the quadrants
            rounds = ((0, 1), (2, None))
            for rnd in rounds:
                for slot, j in enumerate(rnd):
                    expo = (jnp.where(blocks > j, b - cols_of(ends[j], tile), -jnp.inf)
                            if j is not None
                            else jnp.where(or_bounded(second, fast), b - mid, -jnp.inf))
                    ops[slot][...] = (q * jnp.exp2(expo)).astype(dtype)
                plgpu.commit_smem()
                res = matmuls(*[(lhs_s[j] if j is not None else daq16, ops[slot], tile, None,
                                 True, False) for slot, j in enumerate(rnd)])
                for slot, j in enumerate(rnd):
                    expo = (jnp.where(blocks == j, end - b, -jnp.inf) if j is not None
                            else jnp.where(and_exact(second, fast), -jnp.inf, mid - b))
                    dk_x = dk_x + res[slot] * jnp.exp2(expo)

            # the state terms, the gate rows, the stores (over q, k and g)
            dq = dq + load(dqg_s, WGMMA) * jnp.exp2(b)
            dk_s = load(dkg_s, WGMMA) * jnp.exp2(cols_of(ends[-1], tile) - b)
            coef0 = rows_of(jnp.sum(jnp.where(c16 == r16, diag_blk, 0.0), axis=1), tile)
            dstate = cols_of(load(dst_s, COLS), tile)
            # the gate: dg_t = sum_{s >= t} r1_s + sum_{s < t} r2_s + dstate (two scans)
            r1 = q * dq - k * dk_x
            r2 = shift_down(spad, k * dk_s)
            dg = chunk_cumsum(spad, r1, reverse=True) + chunk_cumsum(spad, r2)
            q_s[...] = (dq + coef0 * k).astype(dtype)
            k_s[...] = (dk_x + coef0 * q + dk_s).astype(dtype)
            g_s[...] = dg + dstate
            plgpu.commit_smem()
            for src, dst in ((q_s, dq_ref), (k_s, dk_ref), (g_s, dg_ref)):
                plgpu.copy_smem_to_gmem(src, dst.at[rows, h, cols])
            return carry

        lax.fori_loop(0, parts, part, None)
        plgpu.wait_smem_to_gmem(0)

    kernel = build(body, name="gla_intra_bwd", out_type=out_type, scratch=scratch,
                   grid=(NC, H), grid_names=("n", "h"), lane=True, approx_math=True)
    return kernel(q_rows, k_rows, g_rows, da, dqg, dkg, dstate)
