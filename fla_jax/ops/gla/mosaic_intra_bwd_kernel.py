"""Mosaic GPU (sm_90) chunk-parallel part of the GLA backward: per chunk of C = 64 rows and
head, with b the chunk-local log2 cumsum of g (recomputed: mosaic_intra_kernel.chunk_cumsum),
dA = scale tril(do v^T) and the state terms dqg = scale do S_n^T, dkg = v dS_{n+1}^T:
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
  block's row 8 (dA masked to the quadrants, one product each for dq and dk);
- the diagonal 8 x 8 blocks exactly in fp32: for offsets d = 0..7 the coefficient dA_{i,i-d}
  (a row vector), the partner row read row-shifted, the decay a running product of exp(g);
  dk's terms are formed on row i and moved to row i - d through SMEM.
One CTA (one warpgroup) per (chunk, head); key columns in parts of P (TMA loads per part, dA
once per chunk). Lane lowering semantics (row-shifted buffers).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.tiles import (COLS, F32, LOG2E, WGMMA, build, cols_of, iota, load,
                                   matmuls, rows_of, smem_tile, union, zeros_wgmma)
from .mosaic_intra_kernel import (C, EXACT, NSUB, P, PAD_DIAG, PITCH, SUB, chunk_cumsum,
                                  per_block, scan_buffer, scan_row_of, shift_down,
                                  zero_scan_pads)


def _as_parts(shape, dtype):
    """SMEM tiled and swizzled like a [C, P] part (wgmma wants both operands' swizzles equal):
    a [C, C] left operand next to [C, P] right ones."""
    sw = P * jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, P)),
                                                plgpu.SwizzleTransform(sw)))


def gla_intra_bwd(q_rows, k_rows, g_rows, da, dqg, dkg, dstate):
    """q_rows, k_rows: [R, H, K] (one 16-bit dtype; chunks of C consecutive rows); g_rows:
    [R, H, K] fp32 log-decay (natural log); da: [H, R, C] fp32 (scale tril(do v^T) per chunk,
    zero above the diagonal); dqg, dkg: [R, H, K] fp32; dstate: [H, R // C, K] fp32 (the state
    decay's gate term, el (S_n . dS_{n+1}), on every row of chunk n). Returns dq, dk [R, H, K]
    in q's dtype and dg [R, H, K] fp32 (see the module docstring)."""
    R, H, K = q_rows.shape
    dtype = q_rows.dtype
    NC = R // C
    if R % C or K % P or da.shape != (H, R, C) or dqg.shape != (R, H, K) \
            or dkg.shape != (R, H, K) or g_rows.shape != (R, H, K) \
            or dstate.shape != (H, NC, K):
        raise ValueError(f"gla_intra_bwd: q_rows {q_rows.shape}, g_rows {g_rows.shape}, da "
                         f"{da.shape}, dqg {dqg.shape}, dkg {dkg.shape}, dstate "
                         f"{dstate.shape}; expected [R, H, K] (R % {C} == 0, K % {P} == 0), "
                         f"da [H, R, {C}], dstate [H, R // {C}, K]")
    parts = K // P
    tile, sq, blk16 = (C, P), (C, C), (C, SUB)
    scratch = dict(
        ins=(smem_tile(tile, dtype), smem_tile(tile, dtype), smem_tile(tile, F32),
             smem_tile(tile, F32), smem_tile(tile, F32),            # q, k, g, dqg, dkg
             plgpu.SMEM((P,), F32)),                                # dstate
        da_s=smem_tile(sq, F32),                   # the TMA destination
        # dA in 16 bits: per J < 3 its column block J on the rows below it; on the quadrants
        lhs_s=tuple(_as_parts(sq, dtype) for _ in range(NSUB - 1)), daq16=_as_parts(sq, dtype),
        kpad=plgpu.SMEM((PAD_DIAG + C, PITCH), dtype),
        epad=plgpu.SMEM((PAD_DIAG + C, PITCH), F32),
        zpad=plgpu.SMEM((2, C + EXACT, PITCH), F32),   # dk's exact terms, shifted up
        spad=scan_buffer(reverse=True),
        # the products' operands X, X2, Qy_0..2, Y; before the first part, sharing their
        # memory, a padded copy of dA read in 16-column blocks
        ops_dap=union(tuple(smem_tile(tile, dtype) for _ in range(2 + NSUB)),
                      plgpu.SMEM((C, C + 8), F32)),
        outs=(smem_tile(tile, dtype), smem_tile(tile, dtype), smem_tile(tile, F32)),  # dq dk dg
        bar=plgpu.Barrier(num_arrivals=6), da_bar=plgpu.Barrier(num_arrivals=1),
    )
    out_type = (jax.ShapeDtypeStruct((R, H, K), dtype), jax.ShapeDtypeStruct((R, H, K), dtype),
                jax.ShapeDtypeStruct((R, H, K), F32))

    def body(q_ref, k_ref, g_ref, da_ref, dqg_ref, dkg_ref, dst_ref, dq_ref, dk_ref, dg_ref,
             *, ins, da_s, lhs_s, daq16, kpad, epad, zpad, spad, ops_dap, outs, bar, da_bar):
        q_s, k_s, g_s, dqg_s, dkg_s, dst_s = ins
        ops, da_p = ops_dap
        x_s, x2_s, y_s = ops[0], ops[1], ops[-1]
        qy_s = ops[2:-1]
        n, h = lax.axis_index("n"), lax.axis_index("h")
        rows = pl.ds(n * C, C)
        data = pl.ds(0, P)
        r16 = lax.bitwise_and(iota(blk16, 0), SUB - 1)
        c16 = iota(blk16, 1)
        rb = lax.shift_right_logical(iota(blk16, 0), 4)
        blocks = lax.shift_right_logical(iota(tile, 0), 4)
        second = lax.bitwise_and(iota(tile, 0), SUB - 1) >= EXACT
        zero_scan_pads(spad)
        # the rows above the shifted buffers' data stay zero: the masked rows' terms (a zero
        # coefficient times a product through them) stay finite
        kpad.at[pl.ds(0, C), data][...] = zeros_wgmma(tile).astype(dtype)
        epad.at[pl.ds(0, C), data][...] = zeros_wgmma(tile)
        for buf in range(2):     # rows C .. C + 7 (read by the shifts) stay zero
            zpad.at[buf, pl.ds(EXACT, C), data][...] = zeros_wgmma(tile)

        # dA, once per chunk: fp32 (exact diagonal blocks), 16-bit copies for the products
        plgpu.copy_gmem_to_smem(da_ref.at[h, rows], da_s, da_bar)
        plgpu.barrier_wait(da_bar)
        full = load(da_s, WGMMA)
        r, c = iota(sq, 0), iota(sq, 1)
        quad = ((lax.shift_right_logical(r, 4) == lax.shift_right_logical(c, 4))
                & (lax.bitwise_and(r, SUB - 1) >= EXACT) & (lax.bitwise_and(c, SUB - 1) < EXACT))
        for j in range(NSUB - 1):
            below = (lax.shift_right_logical(r, 4) > j) & (lax.shift_right_logical(c, 4) == j)
            lhs_s[j][...] = jnp.where(below, full, 0.0).astype(dtype)
        daq16[...] = jnp.where(quad, full, 0.0).astype(dtype)
        da_p.at[:, pl.ds(0, C)][...] = full
        plgpu.commit_smem()
        cblocks = [load(da_p.at[:, pl.ds(SUB * j, SUB)], WGMMA) for j in range(NSUB)]
        diag_blk = zeros_wgmma(blk16)      # T[i, c] = dA[i, 16 (i // 16) + c]
        for j in range(NSUB):
            diag_blk = jnp.where(rb == j, cblocks[j], diag_blk)
        plgpu.commit_smem()

        def part(p, carry):
            cols = pl.ds(pl.multiple_of(p * P, P), P)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous part's stores
            plgpu.commit_smem()
            for src, dst in ((q_ref, q_s), (k_ref, k_s), (g_ref, g_s), (dqg_ref, dqg_s),
                             (dkg_ref, dkg_s)):
                plgpu.copy_gmem_to_smem(src.at[rows, h, cols], dst, bar)
            plgpu.copy_gmem_to_smem(dst_ref.at[h, n, cols], dst_s, bar)
            plgpu.barrier_wait(bar)
            x = load(g_s, WGMMA) * LOG2E
            kk = load(k_s, WGMMA)
            q = load(q_s, WGMMA).astype(F32)
            k = kk.astype(F32)
            kpad.at[pl.ds(PAD_DIAG, C), data][...] = kk
            epad.at[pl.ds(PAD_DIAG, C), data][...] = jnp.exp2(x)
            b = chunk_cumsum(spad, x)
            ends = [scan_row_of(spad, SUB * j + SUB - 1)[0] for j in range(NSUB)]
            mids = [scan_row_of(spad, SUB * j + EXACT - 1)[0] for j in range(NSUB)]

            # the diagonal 8 x 8 blocks, exact
            coef0 = rows_of(jnp.sum(jnp.where(c16 == r16, diag_blk, 0.0), axis=1), tile)
            # the pair (i, i) has no decay: its terms q dA_ii k cancel exactly in r1, so they
            # enter dq and dk only after r1 is formed (under strong gates they dominate both)
            dq = zeros_wgmma(tile)
            dk_x = zeros_wgmma(tile)

            def offset(d, cr):
                decay, dq, dk_x = cr
                decay = decay * load(epad.at[pl.ds(PAD_DIAG + 1 - d, C), data], WGMMA)
                kd = load(kpad.at[pl.ds(PAD_DIAG - d, C), data], WGMMA).astype(F32)
                keep = (c16 == r16 - d) & (lax.bitwise_and(r16, EXACT - 1) >= d)
                coef = rows_of(jnp.sum(jnp.where(keep, diag_blk, 0.0), axis=1), tile)
                dq = dq + coef * kd * decay
                zbuf = zpad.at[lax.rem(d, 2)]      # row i's term for key row i - d
                zbuf.at[pl.ds(0, C), data][...] = coef * q * decay
                plgpu.commit_smem()
                dk_x = dk_x + load(zbuf.at[pl.ds(d, C), data], WGMMA)
                return decay, dq, dk_x

            _, dq, dk_x = lax.fori_loop(1, EXACT, offset, (zeros_wgmma(tile) + 1.0, dq, dk_x))

            # the tensor-core operands (16-bit, every factor <= 1)
            end = per_block(blocks, ends, tile)
            mid = per_block(blocks, mids, tile)
            x_s[...] = (k * jnp.exp2(jnp.where(blocks < NSUB - 1, end - b, -jnp.inf))
                        ).astype(dtype)
            x2_s[...] = (k * jnp.exp2(jnp.where(second, -jnp.inf, mid - b))).astype(dtype)
            for j in range(NSUB - 1):
                qy_s[j][...] = (q * jnp.exp2(jnp.where(blocks > j, b - cols_of(ends[j], tile),
                                                       -jnp.inf))).astype(dtype)
            y_s[...] = (q * jnp.exp2(jnp.where(second, b - mid, -jnp.inf))).astype(dtype)
            plgpu.commit_smem()
            prods = [(lhs_s[j], x_s, tile, None, False, False) for j in range(NSUB - 1)]
            prods.append((daq16, x2_s, tile, None, False, False))
            res = matmuls(*prods)
            for j in range(NSUB - 1):
                dq = dq + res[j] * jnp.exp2(jnp.where(blocks > j, b - cols_of(ends[j], tile),
                                                      -jnp.inf))
            dq = dq + res[-1] * jnp.exp2(jnp.where(second, b - mid, -jnp.inf))
            prods = [(lhs_s[j], qy_s[j], tile, None, True, False) for j in range(NSUB - 1)]
            prods.append((daq16, y_s, tile, None, True, False))
            res = matmuls(*prods)
            dk_x = dk_x + res[-1] * jnp.exp2(jnp.where(second, -jnp.inf, mid - b))
            for j in range(NSUB - 1):
                dk_x = dk_x + res[j] * jnp.exp2(jnp.where(blocks == j, end - b, -jnp.inf))

            # the state terms, the gate rows, the stores
            dq = dq + load(dqg_s, WGMMA) * jnp.exp2(b)
            dk_s = load(dkg_s, WGMMA) * jnp.exp2(cols_of(ends[-1], tile) - b)
            dq_o, dk_o, dg_o = outs
            dq_o[...] = (dq + coef0 * k).astype(dtype)
            dk_o[...] = (dk_x + coef0 * q + dk_s).astype(dtype)
            # the gate: dg_t = sum_{s >= t} r1_s + sum_{s < t} r2_s + dstate (two scans)
            r1 = q * dq - k * dk_x
            r2 = shift_down(spad, k * dk_s)
            dg = chunk_cumsum(spad, r1, reverse=True) + chunk_cumsum(spad, r2)
            dg_o[...] = dg + cols_of(load(dst_s, COLS), tile)
            plgpu.commit_smem()
            for src, dst in ((dq_o, dq_ref), (dk_o, dk_ref), (dg_o, dg_ref)):
                plgpu.copy_smem_to_gmem(src, dst.at[rows, h, cols])
            return carry

        lax.fori_loop(0, parts, part, None)
        plgpu.wait_smem_to_gmem(0)

    kernel = build(body, name="gla_intra_bwd", out_type=out_type, scratch=scratch,
                   grid=(NC, H), grid_names=("n", "h"), lane=True, approx_math=True)
    return kernel(q_rows, k_rows, g_rows, da, dqg, dkg, dstate)
