"""Warp-specialized Mosaic GPU (sm_90) map pass of the delta family's sequence split
(mosaic_pieces.py): for every piece of a sequence, its affine map of the state.

A chunk maps the state S [K, V] affinely, S' = A S + B (mosaic_fwd_ws.py's update: A =
exp2(G_last) I - (Gamma'' k)^T Ag Gamma k, B = (Gamma'' k)^T Ag v, Gamma'' = exp2(G_last - G)),
and so does a piece of chunks: S_end = M S_start + E. The value columns of S never mix, so
[M | E] [K, K + V] is the state reached from [I | 0] with the values [0 | v]: the same chunk
recurrence on K + V columns. This kernel walks it without q, the output or any stored state:
    v_new^T = (v^T - (S^T k^T) Gamma) Ag^T,   S^T <- exp2(G_last) S^T + (v_new^T Gamma'') k
on the transposed augmented state [M^T ; E^T] [K + V, K], in blocks of BV = 64 rows; the
first K / BV blocks ("identity blocks") start from rows of I and read no values (v taken as
0), the others start from 0 and read v's columns.

One CTA of three warpgroups per (piece, value head, pair of row blocks):
    WG0, WG1 (state): each carries one row block in fp32 registers (three dependent products
                  per chunk, as mosaic_fwd_ws.py's state warpgroup without publishing).
    WG2 (memory): TMA loads of k, both blocks' v, T0 and the gate vectors into STAGES stages,
                  and Ag = (T0 * D) diag(beta) over T0 one chunk ahead of the carriers (chunk
                  c + 1's while they walk chunk c).
Barriers: in_bar (a stage landed), ag_ready (Ag written), in_free (both carriers done with a
stage), seq_bar (each warpgroup's table row), done.
A piece row of the table gives (first chunk, chunk count of the value blocks, chunk count of
the identity blocks): the split walks only the maps it reads (mosaic_pieces.map_table). A
pair of an identity and a value block (K / BV odd) walks the larger count.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.serial import sequence_range
from ..common.mosaic.tiles import (COLS, F32, ROWS, build, causal_decay, cols_of, iota,
                                   load, matmul, matmuls, smem_tile)
from ..common.mosaic.warpgroups import finish_together, observe_last, registers
from . import mosaic_fwd_ws
from .mosaic_fwd_kernel import BV, C, TABLE_WIDTH
from .mosaic_fwd_ws import ag_over_t0, copy_gate_vectors, gate_vector_scratch, update_decay

MAX_K = 128
STAGES = 3
APPROX_MATH = True      # ex2.approx for the decays (as mosaic_fwd_ws.APPROX_MATH)
SMEM_BUDGET = 220 * 1024
# setmaxnreg of the three warpgroups (two carriers, memory + Ag): 128 * (200 + 200 + 96)
# registers fit the SM's 64 K
REGISTERS = (200, 200, 96)


def smem_bytes(K: int, dtype) -> int:
    """Shared memory of the kernel (each buffer rounded up to 1 KB, as Mosaic aligns them)."""
    isz = jnp.dtype(dtype).itemsize
    kb = lambda n: -(-n // 1024) * 1024          # noqa: E731
    per_stage = kb(C * K * isz) + 2 * kb(C * BV * isz) + kb(C * C * isz)
    vectors = 5 * kb(STAGES * C * 4)
    fixed = 2 * kb(BV * K * 4) + kb(C * C * isz) + kb(3 * TABLE_WIDTH * 4)
    return STAGES * per_stage + vectors + fixed


def supports(K: int, V: int, dtype) -> bool:
    """K <= MAX_K, V a multiple of BV, (K + V) / BV row blocks in pairs, SMEM fits."""
    return (K <= MAX_K and K % BV == 0 and V % BV == 0 and (K + V) // BV % 2 == 0
            and smem_bytes(K, dtype) <= SMEM_BUDGET)


def piece_maps(k, v, t0, gcum, gsuf, beta, table):
    """k: [R, H, K]; v: [R, HV, V] (k's dtype); t0: [HV, R, C] (k's dtype, the gate-free
    inverse of mosaic_kkt.py); gcum, gsuf, beta: [HV, R] fp32 (G and G_last - G in log2 units;
    beta; gsuf unread, may be None, with mosaic_fwd_ws.LATER_IN_KERNEL); table: [P,
    TABLE_WIDTH] int32 (column 0: first chunk of piece p, 1: its chunk count for the value
    blocks, 2: for the identity blocks). Value head hv reads key head
    hv // (HV // H). Returns [M^T ; E^T] [P, HV, K + V, K] fp32 (rows :K hold M^T; a block
    that walks no chunk holds its start, rows of I or 0)."""
    R, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    group = HV // H
    P = table.shape[0]
    dt = k.dtype
    if not supports(K, V, dt):
        raise ValueError(f"piece_maps: K={K}, V={V}, {jnp.dtype(dt).name}; expected K <= {MAX_K}, "
                         f"K and V multiples of {BV} with (K + V) / {BV} even")
    nid = K // BV                       # identity blocks
    pairs = (K + V) // BV // 2
    S = STAGES
    later_in_kernel = bool(mosaic_fwd_ws.LATER_IN_KERNEL)
    gates = gate_vector_scratch(S, later=not later_in_kernel)
    scratch = dict(
        k_s=smem_tile((S, C, K), dt), va_s=smem_tile((S, C, BV), dt),
        vb_s=smem_tile((S, C, BV), dt), t_s=smem_tile((S, C, C), dt),
        **gates,
        st0_s=smem_tile((BV, K), F32), st1_s=smem_tile((BV, K), F32),
        eye_s=smem_tile((C, C), dt),
        seq_s=plgpu.SMEM((3, TABLE_WIDTH), jnp.int32),
        # one arrival per TMA copy: 4 tiles and the gate vectors
        in_bar=plgpu.Barrier(num_arrivals=4 + len(gates), num_barriers=S),
        ag_ready=plgpu.Barrier(num_arrivals=1, num_barriers=S),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=S),
        seq_bar=plgpu.Barrier(num_arrivals=1, num_barriers=3),
        eye_bar=plgpu.Barrier(num_arrivals=1, num_barriers=1),
        done=plgpu.Barrier(num_arrivals=3, num_barriers=1),
    )
    out_type = jax.ShapeDtypeStruct((P, HV, K + V, K), F32)

    def body(*refs, k_s, va_s, vb_s, t_s, g0_s, g1r_s, g1c_s, b1_s, st0_s, st1_s, eye_s, seq_s,
             in_bar, ag_ready, in_free, seq_bar, eye_bar, done, s0_s=None):
        refs = list(refs)
        k_ref, v_ref, t_ref, gc_ref = (refs.pop(0) for _ in range(4))
        gs_ref = None if later_in_kernel else refs.pop(0)
        b_ref, tab_ref, m_ref = refs
        p, hv, pair = lax.axis_index("p"), lax.axis_index("hv"), lax.axis_index("pair")
        wg = lax.axis_index("wg")
        h = lax.div(hv, group)
        blocks = (2 * pair, 2 * pair + 1)

        def bounds():
            """(first chunk, chunk count) of this CTA's pair: each warpgroup reads its row."""
            first, cval = sequence_range(tab_ref, p, seq_s.at[wg], seq_bar.at[wg])
            cid = seq_s[wg, 2]
            a_id, b_id = blocks[0] < nid, blocks[1] < nid
            count = jnp.where(a_id & b_id, cid,
                              jnp.where(a_id | b_id, jnp.maximum(cid, cval), cval))
            return first, count

        def v_cols(b):
            """v's columns of row block b (an identity block reads, and ignores, the first)."""
            return pl.ds(jnp.maximum(b - nid, 0) * BV, BV)

        @pl.when(wg == 2)
        def _memory():
            registers(REGISTERS[2], "decrease")
            first, count = bounds()
            sq = (C, C)

            def issue(c):
                slot = lax.rem(c, S)
                rows, bar = pl.ds((first + c) * C, C), in_bar.at[slot]
                plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(v_ref.at[rows, hv, v_cols(blocks[0])], va_s.at[slot],
                                        bar)
                plgpu.copy_gmem_to_smem(v_ref.at[rows, hv, v_cols(blocks[1])], vb_s.at[slot],
                                        bar)
                plgpu.copy_gmem_to_smem(t_ref.at[hv, rows], t_s.at[slot], bar)
                copy_gate_vectors(gc_ref, gs_ref, b_ref, (g0_s, s0_s, g1r_s, g1c_s, b1_s), hv,
                                  rows, slot, bar)

            for c in range(S):              # the first stages at once
                @pl.when(c < count)
                def _fill(c=c):
                    issue(c)

            def form_ag(c):
                slot = lax.rem(c, S)
                plgpu.barrier_wait(in_bar.at[slot])
                d = causal_decay(load(g1r_s.at[slot], ROWS), load(g1c_s.at[slot], COLS), sq)
                ag_over_t0(t_s.at[slot], b1_s.at[slot], d)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ag_ready.at[slot])

            @pl.when(count > 0)
            def _first():
                form_ag(0)

            def step(c, carry):
                # chunk c + 1's Ag while the carriers walk chunk c (formed only after they
                # released chunk c - 1, it sat on their chain behind their first product),
                # then chunk c + S into chunk c's stage
                @pl.when(c + 1 < count)
                def _ahead():
                    form_ag(c + 1)

                @pl.when(c + S < count)
                def _next():
                    plgpu.barrier_wait(in_free.at[lax.rem(c, S)])
                    issue(c + S)
                return carry

            lax.fori_loop(0, count, step, None)
            observe_last(count, S, in_free)     # the releases no refill waited for

        def carrier(b, v_s, st_s):
            """Row block b of [M^T ; E^T] through the piece's chunks; stores it."""
            registers(REGISTERS[0], "increase")
            first, count = bounds()
            shape, tile = (BV, K), (BV, C)
            # rows b * BV .. of I: zero in the value blocks (b * BV >= K)
            s_t = jnp.where(iota(shape, 1) == iota(shape, 0) + b * BV, 1.0, 0.0).astype(F32)
            keep = jnp.where(b < nid, 0.0, 1.0).astype(F32)    # v = 0 in identity blocks
            plgpu.barrier_wait(eye_bar.at[0])

            def step(c, s_t):
                slot = lax.rem(c, S)
                plgpu.barrier_wait(in_bar.at[slot])
                s_lo = s_t.astype(dt)
                g_col = load(g0_s.at[slot], COLS)
                g_last = g0_s[slot, C - 1]
                k_decay = update_decay(s0_s, slot, g_last, g_col)   # off the chain (fwd_ws)
                # S^T k^T and v^T = v^T I (a transposed register load of a swizzled tile does
                # not lower under jax 0.10), one wait
                sk, v_t = matmuls((s_lo, k_s.at[slot], tile, None, False, True),
                                  (v_s.at[slot], eye_s, tile, None, True, False))
                x = (v_t * keep - sk * cols_of(jnp.exp2(g_col), tile)).astype(dt)   # X^T
                plgpu.barrier_wait(ag_ready.at[slot])
                vn = matmul(x, t_s.at[slot], tile, tb=True)                         # v_new^T
                vd = (vn * cols_of(k_decay, tile)).astype(dt)
                s_new = matmul(vd, k_s.at[slot], shape, init=s_t * jnp.exp2(g_last))
                plgpu.barrier_arrive(in_free.at[slot])
                return s_new

            s_t = lax.fori_loop(0, count, step, s_t)
            st_s[...] = s_t
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(st_s, m_ref.at[p, hv, pl.ds(b * BV, BV)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 0)
        def _carrier0():
            eye_s[...] = jnp.where(iota((C, C), 0) == iota((C, C), 1), 1.0, 0.0).astype(dt)
            plgpu.commit_smem()
            plgpu.barrier_arrive(eye_bar.at[0])
            carrier(blocks[0], va_s, st0_s)

        @pl.when(wg == 1)
        def _carrier1():
            carrier(blocks[1], vb_s, st1_s)

        finish_together(done)

    kernel = build(body, name="gdn_map_ws", out_type=out_type, scratch=scratch,
                   grid=(P, HV, pairs), grid_names=("p", "hv", "pair"), threads=3,
                   approx_math=bool(APPROX_MATH))
    return kernel(k, v, t0, gcum, *([] if later_in_kernel else [gsuf]), beta, table)
