"""Mosaic GPU (sm_90) chunk-parallel part of the GLA forward: per chunk of C = 64 rows and
head, from q, k (16-bit) and the per-key log-decay g (fp32, natural log), in one kernel:
    b_i    = sum_{t <= i} g_t log2(e)        the chunk-local cumsum (log2 units, fp32)
    qg     = q exp2(b),  kg = k exp2(b_last - b)            [C, K] (q's dtype; factors <= 1)
    last   = b_last                                           [K] fp32 (the state's decay)
    A_ij   = sum_c q_ic k_jc exp2(b_ic - b_jc), j <= i        [C, C] (q's dtype)
It replaced XLA ops that took 1.85 of the forward's 2.0 ms at B4 T4096 H16 K=V=128 on the H100
(RESULTS.md run 17: the cumsum as a reduce window, the diagonal blocks as a broadcast-reduce).

One CTA (one warpgroup) per (CHUNKS_PER_CTA chunks, head), nothing sequential between CTAs;
the key columns in parts of P = 32 (TMA loads per part, double-buffered across the parts and
chunks; A accumulates over a chunk's parts):
- cumsum: a Hillis-Steele scan over rows (six steps of b_i += b_{i-s}, the shifted rows read
  back from SMEM above zero rows): fp32, no tensor-core rounding.
- A below the diagonal 16 x 16 blocks (sub-chunks I > J) on the tensor cores: with e_J = b at
  the last row of sub-chunk J, A_IJ = (q_I exp2(b_I - e_J)) . (k_J exp2(e_J - b_J))^T: every
  factor <= 1 (no overflow under any gate), 16-bit operands, fp32 accumulation. Likewise the
  lower-left 8 x 8 quadrant of each diagonal 16 x 16 block, through b at its row 8.
- the diagonal 8 x 8 blocks exactly, per row pair and channel in fp32: for offsets d = 0..7
  the row i's partner i - d is read from row-shifted SMEM, its decay exp2(b_i - b_{i-d}) a
  running product of the per-token exp(g) (<= 1 each; no difference of large cumsums, so no
  cancellation under strong gates).
Stores asynchronous; exp2 approximate (ex2.approx, ~2 ulp of fp32). Lane lowering semantics:
the row-shifted buffers must keep their plain row-major layout (tiles.compiler_params).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.serial import wait_and_prefetch
from ..common.mosaic.tiles import (COLS, F32, LOG2E, WGMMA, build, cols_of, iota, load, matmuls,
                                   rows_of, smem_tile, zeros_wgmma)

C = 64          # chunk rows
SUB = 16        # sub-chunk rows (blocks below them on the tensor cores)
EXACT = 8       # rows of the diagonal blocks formed exactly (the rest of each 16 x 16 diagonal
                # block on the tensor cores, through its row 8)
NSUB = C // SUB
P = 32          # key columns per part
PITCH = P + 8   # row pitch of the row-shifted buffers (conflict-free WGMMA-layout reads)
PAD_SCAN = 33   # zero rows above the scan buffer (shifts up to C / 2; 33: its last row, the
                # TMA source of `last`, starts 128-byte aligned at this pitch)
assert (PAD_SCAN + C - 1) * PITCH * 4 % 128 == 0
SCAN_BUFFERS = 2   # 2: one barrier per scan step (1: two; equal speed on the H100, run 17 call 7)
CHUNKS_PER_CTA = 4   # the next chunk's first loads in flight across the chunk boundary (4: 0.344
                     # vs 0.355 ms for 1 on the H100, RESULTS.md run 17 call 7)
PAD_DIAG = 16   # rows above the shifted k / exp(g) buffers (shifts up to EXACT - 1; 16 keeps
                # their stores 8-row aligned)


# A bounded part (key columns whose gate cumsum b stays within FAST_SPAN[dtype] (log2 units)
# of each diagonal block's middle row m) forms its diagonal blocks on the tensor cores too,
# through factors 2^(b - m) and 2^(m - b) in [2^-span, 2^span]: no exact 8 x 8 loop. The span
# keeps the 16-bit operands in range and, in fp16, out of the subnormals' lost digits (6: a
# factor's operand loses at most 2^-18 absolute there); strong gates take the exact path.
FAST = True
FAST_SPAN = {"bfloat16": 16.0, "float16": 6.0}


def bounded_part(b, mid, dtype):
    """Whether every |b - mid| of the [C, P] part is within FAST_SPAN (a traced scalar bool,
    the same on every thread), or None where FAST is off: the exact path alone is built (the
    helpers below; Mosaic lowers no NumPy bool constants, so no constant False stands in)."""
    if not FAST:
        return None
    per_col = jnp.max(jnp.abs(b - mid), axis=0)     # (one axis at a time: Mosaic's rule)
    return jnp.max(per_col) <= FAST_SPAN[jnp.dtype(dtype).name]


def pick(fast, bounded, exact):
    """`bounded` in a bounded part, else `exact` (fast from bounded_part)."""
    return exact if fast is None else jnp.where(fast, bounded, exact)


def or_bounded(mask, fast):
    """mask, or everywhere in a bounded part."""
    return mask if fast is None else mask | fast


def and_exact(mask, fast):
    """mask, or nowhere in a bounded part."""
    return mask if fast is None else mask & ~fast


def per_block(blocks, values, shape):
    """Row i takes values[blocks[i]] (a COLS vector, or None for zero)."""
    out = jnp.zeros(shape, F32)
    for blk, val in enumerate(values):
        if val is not None:
            out = jnp.where(blocks == blk, cols_of(val, shape), out)
    return out


PAD_BELOW = 39   # zero rows below the data for reverse scans (shifts up to C / 2; 39: the
                 # buffer's last C rows start 8-row aligned, where they are zeroed)


def scan_buffer(reverse: bool = False, buffers: int = SCAN_BUFFERS):
    """SMEM of chunk_cumsum: `buffers` row-shifted fp32 buffers of a [C, P] part (with zero
    rows below the data too where reverse scans run; one buffer: two barriers per step)."""
    return plgpu.SMEM((buffers, PAD_SCAN + C + (PAD_BELOW if reverse else 0), PITCH), F32)


def zero_scan_pads(spad):
    """Once per kernel: the rows around the data (read by the shifts) are zero."""
    rows = spad.shape[1]
    for buf in range(spad.shape[0]):
        spad.at[buf, pl.ds(0, C), pl.ds(0, P)][...] = zeros_wgmma((C, P))
        if rows > PAD_SCAN + C:
            spad.at[buf, pl.ds(rows - C, C), pl.ds(0, P)][...] = zeros_wgmma((C, P))


def chunk_cumsum(spad, x, reverse: bool = False):
    """x [C, P] fp32 (WGMMA layout) -> its inclusive cumsum over the rows (reverse: from the
    last row, b_i = sum_{s >= i} x_s; spad from scan_buffer(reverse=True)): a Hillis-Steele
    scan, b_i += b_{i -+ s} for s = 1, 2, ..., C / 2, the shifted rows read back from SMEM next
    to zero rows; with two buffers a step's store cannot race the previous step's shifted reads
    (one barrier per step). The result is also left in buffer 0 (scan_row_of)."""
    data = pl.ds(0, P)
    b = x
    buffers = spad.shape[0]
    for level in range(C.bit_length() - 1):
        buf = spad.at[level % buffers]
        buf.at[pl.ds(PAD_SCAN, C), data][...] = b
        plgpu.commit_smem()
        shift = -(1 << level) if not reverse else (1 << level)
        b = b + load(buf.at[pl.ds(PAD_SCAN + shift, C), data], WGMMA)
        if buffers == 1:
            plgpu.commit_smem()
    spad.at[0, pl.ds(PAD_SCAN, C), data][...] = b
    plgpu.commit_smem()
    return b


def shift_down(spad, x):
    """x [C, P] moved down one row (row 0 zero), through the scan buffer: the input of an
    exclusive cumsum. Leaves the buffers free for chunk_cumsum."""
    buf = spad.at[0]
    buf.at[pl.ds(PAD_SCAN, C), pl.ds(0, P)][...] = x
    plgpu.commit_smem()
    out = load(buf.at[pl.ds(PAD_SCAN - 1, C), pl.ds(0, P)], WGMMA)
    plgpu.commit_smem()
    return out


def scan_row_of(spad, r):
    """Row r of chunk_cumsum's result: a COLS vector and its ref view (a TMA source)."""
    view = spad.at[0, PAD_SCAN + r, pl.ds(0, P)]
    return load(view, COLS), view


def gla_intra(q_rows, k_rows, g_rows):
    """q_rows, k_rows: [R, H, K] (one 16-bit dtype; R a multiple of C, chunks of C consecutive
    rows); g_rows: [R, H, K] fp32 log-decay (natural log, <= 0). K a multiple of P. Returns
    qg, kg [R, H, K] and A [H, R, C] in q's dtype, last [H, R // C, K] fp32 (see the module
    docstring)."""
    R, H, K = q_rows.shape
    dtype = q_rows.dtype
    if R % C or K % P or k_rows.shape != (R, H, K) or g_rows.shape != (R, H, K):
        raise ValueError(f"gla_intra: q_rows {q_rows.shape}, k_rows {k_rows.shape}, g_rows "
                         f"{g_rows.shape}; expected one shape [R, H, K] with R % {C} == 0 and "
                         f"K % {P} == 0")
    NC = R // C
    parts = K // P
    cpc = max(1, min(CHUNKS_PER_CTA, NC))
    tile, sq, blk16 = (C, P), (C, C), (C, SUB)
    scratch = dict(
        # q, k, g: two stages (the next part's loads in flight while one is computed)
        ins=(smem_tile((2, *tile), dtype), smem_tile((2, *tile), dtype),
             smem_tile((2, *tile), F32)),
        outs=tuple(smem_tile(tile, dtype) for _ in range(4)),    # x, x2, qg, kg
        kpad=plgpu.SMEM((PAD_DIAG + C, PITCH), dtype),
        epad=plgpu.SMEM((PAD_DIAG + C, PITCH), F32),
        spad=scan_buffer(),
        a_s=plgpu.SMEM(sq, dtype),   # untiled: written in 16-column blocks
        bar=plgpu.Barrier(num_arrivals=3, num_barriers=2),
    )
    out_type = (jax.ShapeDtypeStruct((R, H, K), dtype), jax.ShapeDtypeStruct((R, H, K), dtype),
                jax.ShapeDtypeStruct((H, R, C), dtype), jax.ShapeDtypeStruct((H, NC, K), F32))

    def body(q_ref, k_ref, g_ref, qg_ref, kg_ref, a_ref, last_ref, *, ins, outs, kpad, epad,
             spad, a_s, bar):
        (q_s, k_s, g_s), (x_s, x2_s, qg_s, kg_s) = ins, outs
        h = lax.axis_index("h")
        first = lax.axis_index("n") * cpc                   # the CTA's chunks: first ..
        steps = jnp.minimum(cpc, NC - first) * parts        # .. one step per (chunk, part)

        data = pl.ds(0, P)

        def locate(t):
            """Step t's chunk (global index), its rows and its key columns."""
            n = first + lax.div(t, parts)
            cols = pl.ds(pl.multiple_of(lax.rem(t, parts) * P, P), P)
            return n, pl.ds(n * C, C), cols
        r16 = lax.bitwise_and(iota(blk16, 0), SUB - 1)     # row within its sub-chunk
        c16 = iota(blk16, 1)
        blocks = lax.shift_right_logical(iota(tile, 0), 4)
        rb = lax.shift_right_logical(iota(blk16, 0), 4)     # sub-chunk of the row
        zero_scan_pads(spad)

        def issue(t, slot):
            _, rows, cols = locate(t)
            for src, dst in ((q_ref, q_s), (k_ref, k_s), (g_ref, g_s)):
                plgpu.copy_gmem_to_smem(src.at[rows, h, cols], dst.at[slot], bar.at[slot])

        plgpu.commit_smem()
        issue(0, 0)

        def run_step(t, carry):
            n, rows, cols = locate(t)
            p = lax.rem(t, parts)
            # a chunk's first part starts its sums of A over the key columns
            diag = jnp.where(p == 0, 0.0, carry[0])
            offs = tuple(jnp.where(p == 0, 0.0, o) for o in carry[1])
            slot = lax.rem(t, 2)
            # every thread is done with the other stage (read before step t - 1's barriers)
            wait_and_prefetch(t, steps, slot, 2, bar, issue)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous step's stores
            plgpu.commit_smem()
            x = load(g_s.at[slot], WGMMA) * LOG2E
            kk = load(k_s.at[slot], WGMMA)
            q = load(q_s.at[slot], WGMMA).astype(F32)
            kpad.at[pl.ds(PAD_DIAG, C), data][...] = kk
            epad.at[pl.ds(PAD_DIAG, C), data][...] = jnp.exp2(x)
            b = chunk_cumsum(spad, x)
            ends = [scan_row_of(spad, SUB * j + SUB - 1)[0] for j in range(NSUB)]
            mids = [scan_row_of(spad, SUB * j + EXACT - 1)[0] for j in range(NSUB)]
            k = kk.astype(F32)
            mid = per_block(blocks, mids, tile)
            fast = bounded_part(b, mid, dtype)

            # diagonal 8 x 8 blocks, exact (none in a bounded part): offset d = 0 (no decay),
            # then the partner row i - d
            d0 = jnp.where(c16 == r16, rows_of(jnp.sum(q * k, axis=1), blk16), 0.0)
            diag = diag + pick(fast, 0.0, d0)

            def offset(d, c):
                decay, dg = c
                decay = decay * load(epad.at[pl.ds(PAD_DIAG + 1 - d, C), data], WGMMA)
                kd = load(kpad.at[pl.ds(PAD_DIAG - d, C), data], WGMMA).astype(F32)
                val = rows_of(jnp.sum(q * kd * decay, axis=1), blk16)
                keep = (c16 == r16 - d) & (lax.bitwise_and(r16, EXACT - 1) >= d)
                return decay, dg + jnp.where(keep, val, 0.0)

            _, diag = lax.fori_loop(1, pick(fast, 1, EXACT), offset,
                                    (zeros_wgmma(tile) + 1.0, diag))

            # on the tensor cores, all products issued together (one wait):
            # - the lower-left 8 x 8 quadrant of each diagonal block through m_J = b at row
            #   16 J + 7: (q_i exp2(b_i - m_J)) . (k_j exp2(m_J - b_j)), i >= 8 > j (a bounded
            #   part: the whole lower triangle of each diagonal block, every row's factor)
            # - the blocks below the diagonal ones through e_J: k_J exp2(e_J - b_J) on the right,
            #   q_I exp2(b_I - e_J) on the left
            second = lax.bitwise_and(iota(tile, 0), SUB - 1) >= EXACT
            x2_s[...] = (k * jnp.exp2(jnp.where(and_exact(second, fast), -jnp.inf, mid - b))
                         ).astype(dtype)
            lhs = (q * jnp.exp2(jnp.where(or_bounded(second, fast), b - mid, -jnp.inf))
                   ).astype(dtype)
            x_s[...] = (k * jnp.exp2(jnp.where(blocks < NSUB - 1,
                                               per_block(blocks, ends, tile) - b, -jnp.inf))
                        ).astype(dtype)
            plgpu.commit_smem()
            prods = [(lhs, x2_s.at[pl.ds(SUB * j, SUB)], blk16, None, False, True)
                     for j in range(NSUB)]
            for j in range(NSUB - 1):
                expo = jnp.where(blocks > j, b - cols_of(ends[j], tile), -jnp.inf)
                prods.append(((q * jnp.exp2(expo)).astype(dtype),
                              x_s.at[pl.ds(SUB * j, SUB)], blk16, offs[j], False, True))
            res = matmuls(*prods)
            quadrant = pick(fast, c16 <= r16, (r16 >= EXACT) & (c16 < EXACT))
            for j in range(NSUB):
                diag = diag + jnp.where(quadrant & (rb == j), res[j], 0.0)
            new_offs = res[NSUB:]
            # the chunk-parallel factors of the state pass
            qg_s[...] = (q * jnp.exp2(b)).astype(dtype)
            kg_s[...] = (k * jnp.exp2(cols_of(ends[-1], tile) - b)).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qg_s, qg_ref.at[rows, h, cols])
            plgpu.copy_smem_to_gmem(kg_s, kg_ref.at[rows, h, cols])
            plgpu.copy_smem_to_gmem(scan_row_of(spad, C - 1)[1], last_ref.at[h, n, cols])

            @pl.when(p == parts - 1)     # the chunk's A is complete (a_s: waited above)
            def _():
                for j in range(NSUB):
                    below = jnp.where(rb > j, new_offs[j], 0.0) if j < NSUB - 1 else 0.0
                    a_s.at[:, pl.ds(SUB * j, SUB)][...] = jnp.where(rb == j, diag,
                                                                    below).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(a_s, a_ref.at[h, rows])
            return diag, tuple(new_offs)

        zero16 = zeros_wgmma(blk16)
        lax.fori_loop(0, steps, run_step, (zero16, (zero16,) * (NSUB - 1)))
        plgpu.wait_smem_to_gmem(0)

    kernel = build(body, name="gla_intra", out_type=out_type, scratch=scratch,
                   grid=(pl.cdiv(NC, cpc), H), grid_names=("n", "h"),
                   lane=True,   # row-shifted views
                   approx_math=True)
    return kernel(q_rows, k_rows, g_rows)
