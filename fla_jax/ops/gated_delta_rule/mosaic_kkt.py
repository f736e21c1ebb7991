"""Mosaic GPU (sm_90) kernel for the gate-free inverse of the delta rule's forward, per chunk:
    T0 = (I + A)^-1,   A = tril(beta_i k_i . k_j, -1)   ([C, C] per chunk and value head).
It replaced a batched XLA einsum + levelled inverse: the H100 forward 0.673 -> 0.394 ms at
B4 T4096 H16 K=V=128 bf16 (RESULTS.md run 14).

One CTA (one warpgroup) per (chunk, value head), chunk-parallel, nothing sequential:
- k k^T by one wgmma (16-bit operands, fp32 accumulation: exact products).
- INVERSE = "substitution" (the default): the inverse of A's diagonal SUBST_BLOCK-sized blocks
  by column-wise forward substitution in lane-level code (common/mosaic/substitution.py, exact
  in fp32; padded fp32 buffers, a loop of loads and FMAs only), then the remaining levels of
  the doubling below (one level from 32 x 32 blocks). H100 B4 T4096 H16: 71.3 us (167
  registers, RESULTS.md run 20; 99.5 us with the solve storing into its input buffer).
- INVERSE = "doubling": recursive doubling over block sizes s = 1, 2, 4, 8, 16, 32: with
  D_s = (I + A_s)^-1 for A_s the part of A inside the diagonal s x s blocks, and L_s the
  part of A in the (odd, even)
  block pairs of each 2s x 2s diagonal block, I + A_2s = (I + A_s)(I + D_s L_s) and
  (D_s L_s)^2 = 0, so
      D_2s = (I - D_s L_s) D_s = D_s - (D_s L_s) D_s,     D_2 = I - L_1,   T0 = D_64.
  Ten [C, C] products (two per level from s = 2), each on the tensor cores as three bf16
  products of hi / lo splits (x = x_hi + x_lo; ~2^-16 relative per product; the three chained
  on one accumulator, one wait): no 64-step substitution, no per-element loop. The factors are
  inverses of diagonal blocks and blocks of A, never powers of A: the product form (I - A)(I +
  A^2)(I + A^4)... multiplies binomially growing powers, and with correlated keys and beta
  near 2 it lost every digit (tested against
  float64; this form matches the XLA inverse's error there).
Then, optionally, from T0 as rounded to the activations' dtype, the WY factors (-W' for the
backward; U^T too for the one-warpgroup forward, mosaic_fwd_kernel.py; the warp-specialized
forward reads T0 alone):
    -W' = -(T0 * D) diag(beta exp2(G - G_0)) k   [C, K]  (W = exp2(G_0) W', relative to the
          chunk's first row: no fp16 underflow under strong gates),
    U^T = v^T ((T0 * D) diag(beta))^T            [V, C]  (transposed: v_new^T's layout),
with D_ij = exp2(G_i - G_j) (i >= j). Outputs in the activations' dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.tiles import (COLS, F32, ROWS, build, causal_decay, cols_of, iota, load,
                                   matmul, matmul_sum, rows_of, smem_tile, union)
from ..common.mosaic.serial import wait_and_prefetch
from ..common.mosaic import substitution
from ..common.mosaic.substitution import BLOCKS, unit_lower_inverse
from .mosaic_fwd_kernel import C   # the chunk length the fused forward reads T0 in

LEVELS = C.bit_length() - 1    # block sizes 1, 2, ..., C / 2 merged
# Chunks per CTA: None (the default: CHUNKS_PER_CTA_AUTO, T0 alone or with U^T / T0 and -W') or a
# count. One chunk per CTA: 4096 CTAs at B4 T4096 HV16, up to 3 per SM; several: inputs and T0
# tiles double-buffered, the next chunk's loads and earlier chunks' stores in flight while a
# chunk is computed (bitwise equal to one per CTA on the H100, benchmarks/mosaic_t0_check.py).
# Timed alone on the H100 (RESULTS.md run 20, 1 / 2 / 4 / 8): T0 84 / 97 / 90 / 91 us, T0 + -W'
# (the training forward's under mosaic_bwd.REVERSE = "wy"; the default reverse pass reads T0
# alone) 144 / 128 / 122 / 125 us: the -W' stores want chunks in flight
CHUNKS_PER_CTA = None
CHUNKS_PER_CTA_AUTO = (1, 4)
# How T0 is formed: "substitution" (the default: column-wise forward substitution in lane-level
# code, exact in fp32, common/mosaic/substitution.py; GPU-proven in RESULTS.md run 19, faster:
# GDN B4 T4096 bf16 fwd 0.354 vs 0.379 ms) or "doubling" (the ten hi / lo products above;
# GPU-proven in runs 15-18, selectable)
INVERSE = "substitution"
# The substitution's block (substitution.BLOCKS): C solves all of T0 in the lane-level code (the
# slowest warp runs 2016 chain FMAs); 32 / 16 solve the diagonal blocks only (496 / 120 FMAs,
# every block on its own warp) and complete T0 by the last one / two doubling levels. None (the
# default): 16 under a one-product merge (fp16 / single), 32 under hilo (three products a step)
SUBST_BLOCK = None
BF16 = jnp.bfloat16
# The doubling's products: "fp16" (the default: one product of operands rounded to float16
# whatever the activations' dtype, 2^-11 relative), "hilo" (opt-in: three bf16 products of hi /
# lo splits, ~2^-16 relative, T0 exact to its output rounding) or "single" (opt-in: one product
# of operands rounded to the activations' dtype; bf16's lose too much: below).
# H100, T0 alone at B4 T4096 H16 (RESULTS.md run 23 call 1, run 24 call 1): bf16 80.5 us (hilo,
# block 32) -> 71.1 (fp16, 32) -> 60.4 (fp16, 16; jla's kkt_fwd 59.9); fp16 activations 86.3
# (hilo, 32) -> 71.3 (fp16, 32) -> 61.3 (fp16, 16); hilo for the 16 -> 32 level, fp16 for the
# last: 85.7 (not kept). The whole fp16 forward 0.225 -> 0.210 ms (bf16 0.202 / 0.206).
# Accuracy (on-GPU T0 vs float64, nearly parallel keys; mosaic_t0_check.py): bf16 activations
# 2.11e-3 (fp16, 16) vs 1.25e-3 exact (hilo) and 1.4e-2 single; fp16 activations 1.71e-3 vs
# 1.56e-4 exact, i.e. ~11x T0's fp16 rounding, but the op's outputs barely move: GPU parity
# in fp16 (GDN 4k / strong_uniform / varlen / strong_edges / t16k / gqa, delta 4k /
# strong_uniform: o, ht and every gradient vs float64) 1.00-1.03x hilo's error, and nearly
# parallel keys (interpreted, benchmarks/mosaic_t0_e2e.py) o 1.11-1.14x, ht 1.09-1.42x hilo's
# (bf16: o 1.00x, ht 1.09x). The fp16 operands are D_s (inverses of diagonal blocks: entries
# within max(1, max beta) for unit-norm keys in a float64 sweep of random and nearly parallel
# keys, beta in (0, 2]) and blocks of A (beta_i k_i . k_j): the latter overflow float16 (to inf)
# only where beta |k|^2 > 65504, far outside the delta rule's stable range (beta |k|^2 <= 2)
MERGE = "fp16"
MERGES = ("hilo", "single", "fp16")


def chunks_per_cta(wy: bool, with_u: bool) -> int:
    """Chunks per CTA of the T0 kernel forming T0 (and -W' with wy, U^T with with_u):
    CHUNKS_PER_CTA, or when None CHUNKS_PER_CTA_AUTO's entry (the second for -W' without U^T)."""
    if CHUNKS_PER_CTA is not None:
        return CHUNKS_PER_CTA
    return CHUNKS_PER_CTA_AUTO[int(wy and not with_u)]


def gate_free_inverse_mosaic(k_rows, beta_t, group: int, dtype, *, gcum=None, v_rows=None,
                             with_t0: bool = True):
    """k_rows: [R, H, K] (16-bit; R a multiple of C, chunks of C rows); beta_t: [HV, R] fp32,
    HV = H * group (value head hv reads key head hv // group); gcum: None or [HV, R] fp32 (the
    chunk-local gate cumsum G in log2 units; zeros for the delta rule): with it -W' is formed
    too; v_rows: None or [R, HV, V] (16-bit, V a multiple of 64; needs gcum): with it U^T too.
    Returns a tuple, in this order, of
      T0 [HV, R, C]     (when with_t0): rows n*C .. n*C + C - 1 hold chunk n's
                        (I + tril(beta_i k_i . k_j, -1))^-1,
      -W' [HV, R, K]    (with gcum), U^T [HV, V, R] (with v_rows; see the module docstring),
    all in `dtype`."""
    R, H, K = k_rows.shape
    HV = beta_t.shape[0]
    if R % C or HV != H * group or beta_t.shape[1] != R:
        raise ValueError(f"gate_free_inverse_mosaic: k_rows {k_rows.shape}, beta_t "
                         f"{beta_t.shape}, group {group}; expected R % {C} == 0, "
                         f"beta_t [H * group, R]")
    if gcum is None and v_rows is not None:
        raise ValueError(f"gate_free_inverse_mosaic: v_rows {v_rows.shape} without gcum; "
                         f"expected gcum [{HV}, {R}] with it (U^T needs the gated inverse)")
    wy, with_u = gcum is not None, v_rows is not None
    if wy and gcum.shape != (HV, R):
        raise ValueError(f"gate_free_inverse_mosaic: gcum {gcum.shape}; expected [{HV}, {R}]")
    if with_u and (v_rows.shape[:2] != (R, HV) or v_rows.shape[2] % C):
        raise ValueError(f"gate_free_inverse_mosaic: v_rows {v_rows.shape}; expected "
                         f"[{R}, {HV}, V] with V a multiple of {C}")
    if not (with_t0 or wy):
        raise ValueError("gate_free_inverse_mosaic: no output requested (with_t0=False and "
                         "no gcum)")
    nv = v_rows.shape[2] // C if with_u else 0
    NC = R // C
    cpb = max(1, min(chunks_per_cta(wy, with_u), NC))
    multi = cpb > 1
    # multi: inputs double-buffered (slot = chunk parity), the next chunk's loads in flight
    # while this one is computed, its stores left asynchronous
    stack = (lambda shape: (2, *shape)) if multi else (lambda shape: shape)
    sq = (C, C)
    if INVERSE not in ("doubling", "substitution"):
        raise ValueError(f"mosaic_kkt.INVERSE={INVERSE!r}; expected 'doubling' or "
                         f"'substitution'")
    subst = INVERSE == "substitution"
    beta_cols = wy or subst       # beta as columns (A^T for the substitution, the WY factors)
    vec_arrivals = 2 + (2 if wy else 0) + (1 if beta_cols else 0)
    scratch = dict(
        k_s=smem_tile(stack((C, K)), k_rows.dtype),
        b_s=plgpu.SMEM(stack((C,)), F32),
        t_s=smem_tile(stack(sq), dtype),
        bar=plgpu.Barrier(num_arrivals=vec_arrivals + (0 if multi else nv),
                          num_barriers=2 if multi else 1),
    )
    if MERGE not in MERGES:
        raise ValueError(f"mosaic_kkt.MERGE={MERGE!r}; expected one of {MERGES}")
    single = MERGE in ("single", "fp16")
    block = SUBST_BLOCK if SUBST_BLOCK is not None else 16 if single else 32
    if subst and block not in BLOCKS:
        raise ValueError(f"mosaic_kkt.SUBST_BLOCK={SUBST_BLOCK!r}; expected one of {BLOCKS} "
                         "or None")
    # the inverse's scratch (the substitution's padded -A^T and X, the doubling's hi / lo
    # operands) and a_s (the gated inverse after it) are never live together: they share memory
    sub = substitution.scratch(C) if subst else None
    op_dtype = jnp.float16 if MERGE == "fp16" else dtype if single else BF16
    hilo = ((smem_tile(sq, op_dtype), smem_tile(sq, op_dtype)) if not subst or block < C
            else None)
    a_tile = smem_tile(sq, dtype) if wy else None
    parts = [x for x in (sub, hilo, a_tile) if x is not None]
    scratch["inv_a"] = union(*parts) if len(parts) > 1 else tuple(parts)
    if beta_cols:
        scratch.update(bc_s=plgpu.SMEM(stack((C,)), F32))
    if wy:   # G as rows and as columns (one buffer per layout); -W'
        scratch.update(g_r=plgpu.SMEM(stack((C,)), F32), g_c=plgpu.SMEM(stack((C,)), F32),
                       w_s=smem_tile((C, K), dtype))
    if with_u:    # v, U^T
        scratch.update(v_s=smem_tile((nv, C, C), dtype), u_s=smem_tile((nv, C, C), dtype))
        if multi:   # one v buffer: the next chunk's v is loaded once this chunk's U^T is formed
            scratch.update(v_bar=plgpu.Barrier(num_arrivals=nv, num_barriers=1))

    def body(*refs, k_s, b_s, t_s, bar, inv_a, g_r=None, g_c=None, bc_s=None,
             w_s=None, v_s=None, u_s=None, v_bar=None):
        inv_a = list(inv_a)
        na_s = inv_a.pop(0) if sub is not None else None
        hi_s, lo_s = inv_a.pop(0) if hilo is not None else (None, None)
        a_s = inv_a.pop(0) if a_tile is not None else None
        refs = list(refs)
        k_ref, b_ref = refs[:2]
        g_ref = refs[2] if wy else None
        v_ref = refs[3] if with_u else None
        outs = refs[2 + wy + with_u:]
        t_ref = outs.pop(0) if with_t0 else None
        w_ref = outs.pop(0) if wy else None
        u_ref = outs.pop(0) if with_u else None
        n, hv = lax.axis_index("n"), lax.axis_index("hv")

        def at(ref, slot):
            return ref if slot is None else ref.at[slot]

        def load_v(ci, b):
            for j in range(nv):
                plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(ci * C, C), hv, pl.ds(j * C, C)],
                                        v_s.at[j], b)

        def load_chunk(ci, slot):
            """TMA loads of chunk ci's k and vectors into `slot` (None: the unstacked buffers,
            and v too)."""
            rows, b = pl.ds(ci * C, C), bar.at[0 if slot is None else slot]
            plgpu.copy_gmem_to_smem(k_ref.at[rows, lax.div(hv, group)], at(k_s, slot), b)
            plgpu.copy_gmem_to_smem(b_ref.at[hv, rows], at(b_s, slot), b)
            if wy:
                for dst in (g_r, g_c):
                    plgpu.copy_gmem_to_smem(g_ref.at[hv, rows], at(dst, slot), b)
            if beta_cols:
                plgpu.copy_gmem_to_smem(b_ref.at[hv, rows], at(bc_s, slot), b)
            if slot is None:
                load_v(ci, b)

        def prod(x, y):
            """x @ y for fp32 register tiles: y's hi / lo parts through SMEM, three wgmmas."""
            if single:      # operands rounded once (MERGE: to dtype, or to fp16)
                hi_s[...] = y.astype(op_dtype)
                plgpu.commit_smem()
                return matmul(x.astype(op_dtype), hi_s, sq)
            y_hi = y.astype(BF16)
            hi_s[...] = y_hi
            lo_s[...] = (y - y_hi.astype(F32)).astype(BF16)
            plgpu.commit_smem()
            x_hi = x.astype(BF16)
            x_lo = (x - x_hi.astype(F32)).astype(BF16)
            return matmul_sum(((x_hi, hi_s), (x_hi, lo_s), (x_lo, hi_s)), sq)   # one wait

        def compute(ci, slot, end=None):
            """Chunk ci from the inputs in `slot`: T0, then -W' and U^T; stores issued. end
            (multi-chunk kernel): the CTA's chunks end before it; the next one's v is loaded
            here."""
            rows = pl.ds(ci * C, C)
            k_c = at(k_s, slot)
            r, c = iota(sq, 0), iota(sq, 1)
            kk = matmul(k_c, k_c, sq, tb=True)
            if subst:    # -A^T [j, i] = -beta_i k_i . k_j for i > j (k k^T is symmetric)
                neg_at = jnp.where(c > r, -(kk * cols_of(load(at(bc_s, slot), COLS), sq)), 0.0)
                t0 = unit_lower_inverse(neg_at, na_s, block)
                if block < C:      # the diagonal blocks' inverse, doubled to T0
                    t0 = doubling(kk, slot, r, c, t0, block.bit_length() - 1)
            else:
                t0 = doubling(kk, slot, r, c)
            finish(ci, slot, rows, k_c, t0.astype(dtype), end)

        def doubling(kk, slot, r, c, d=None, level0=1):
            """T0 by recursive doubling (the module docstring), fp32; from d = D_s, s =
            2^level0, the inverse of A's diagonal s x s blocks (None: D_2 from A)."""
            a = jnp.where(r > c, kk * rows_of(load(at(b_s, slot), ROWS), sq), 0.0)

            def pair_part(level):
                """A in the (odd, even) s x s block pairs of the 2s x 2s diagonal blocks,
                s = 2^level."""
                pair = (lax.shift_right_logical(r, level + 1)
                        == lax.shift_right_logical(c, level + 1))
                other = lax.shift_right_logical(r, level) != lax.shift_right_logical(c, level)
                return jnp.where(pair & other, a, 0.0)

            if d is None:
                d = jnp.where(r == c, 1.0, 0.0) - pair_part(0)
            for level in range(level0, LEVELS):
                p = prod(d, pair_part(level))
                d = d - prod(p, d)
            return d

        def finish(ci, slot, rows, k_c, t0, end):
            """Store T0; form and store -W' (wy) and U^T (with_u) from it."""
            # multi: the stores of earlier chunks still in flight (the bulk groups issued
            # after the one that read the buffer about to be written), per chunk in the order
            # T0 (slot = chunk parity), -W', U^T tiles (one buffer each)
            n_t, n_w = int(with_t0), int(wy)
            if with_t0:
                if multi:   # chunk ci - 2's T0 store has read this slot
                    plgpu.wait_smem_to_gmem(n_w + nv + (n_t + n_w + nv), wait_read_only=True)
                at(t_s, slot)[...] = t0
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(at(t_s, slot), t_ref.at[hv, rows])
            if not wy:
                return
            if multi:       # chunk ci - 1's -W' store has read w_s
                plgpu.wait_smem_to_gmem(nv + n_t, wait_read_only=True)
            g_col = load(at(g_c, slot), COLS)
            tg = t0.astype(F32) * causal_decay(load(at(g_r, slot), ROWS), g_col, sq)   # T0 * D
            beta_c = load(at(bc_s, slot), COLS)
            # -W' = -(T0 * D) diag(beta exp2(G - G_0)) k
            g_first = at(g_r, slot)[0]
            a_s[...] = (tg * cols_of(beta_c * jnp.exp2(g_col - g_first), sq)).astype(dtype)
            plgpu.commit_smem()
            w_s[...] = (-matmul(a_s, k_c, (C, K))).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(w_s, w_ref.at[hv, rows])
            if not with_u:
                return
            # U^T = v^T Ag^T, Ag = (T0 * D) diag(beta); a_s is free again (waited)
            a_s[...] = (tg * cols_of(beta_c, sq)).astype(dtype)
            plgpu.commit_smem()
            if multi:
                plgpu.barrier_wait(v_bar.at[0])
                # chunk ci - 1's U^T stores have read u_s
                plgpu.wait_smem_to_gmem(n_t + n_w, wait_read_only=True)
            for j in range(nv):
                u_s.at[j][...] = matmul(v_s.at[j], a_s, sq, ta=True, tb=True).astype(dtype)
            if multi:   # v_s has been read: the next chunk's v
                @pl.when(ci + 1 < end)
                def _():
                    load_v(ci + 1, v_bar.at[0])
            plgpu.commit_smem()
            for j in range(nv):
                plgpu.copy_smem_to_gmem(u_s.at[j], u_ref.at[hv, pl.ds(j * C, C), rows])

        if not multi:
            load_chunk(n, None)
            plgpu.barrier_wait(bar.at[0])
            compute(n, None)
        else:
            first = n * cpb
            count = jnp.minimum(cpb, NC - first)
            load_chunk(first, 0)
            if with_u:
                load_v(first, v_bar.at[0])

            def step(i, carry):
                slot = lax.rem(i, 2)
                wait_and_prefetch(i, count, slot, 2, bar, lambda j, s: load_chunk(first + j, s))
                compute(first + i, slot, first + count)
                return carry
            lax.fori_loop(0, count, step, 0)
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct((HV, R, C), dtype)] if with_t0 else []
    if wy:
        out_type += [jax.ShapeDtypeStruct((HV, R, K), dtype)]
    if with_u:
        out_type += [jax.ShapeDtypeStruct((HV, nv * C, R), dtype)]
    kernel = build(body, name="gdn_kkt_inverse", out_type=out_type,
                   scratch=scratch, grid=(-(-NC // cpb), HV), grid_names=("n", "hv"))
    args = [k_rows, beta_t] + ([gcum] if wy else []) + ([v_rows] if with_u else [])
    return tuple(kernel(*args))
