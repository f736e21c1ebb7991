"""Warp-specialized Mosaic GPU (sm_90) forward of the chunked gated delta rule (inference: output
and final state), one CTA of three warpgroups per (sequence, value head, 64 value columns).

It reads the gate-free inverse T0 (mosaic_kkt.py, T0 only) instead of the WY factors -W' and
U^T, which then never exist in HBM (48 KB fewer bytes per chunk and head than
mosaic_fwd_kernel.py's inputs + the T0 kernel's outputs). With G the chunk-local cumsum of g
(log2 units), Gamma = exp2(G), D_ij = exp2(G_i - G_j) (i >= j) and Ag = (T0 * D) diag(beta),
the WY form u - w S with u = Ag v, w = Ag Gamma k is applied as
    v_new = Ag (v - Gamma (k S)),
so that per chunk:
    WG0 (state):  S^T in fp32 registers. Publishes S^T (input dtype) for WG1, then
                  X^T = v^T - (S^T k^T) Gamma,  v_new^T = X^T Ag^T  (published too;
                  v^T by a product with the identity issued with S^T k^T, or by a
                  transposed register load of v's tile, IDENTITY_V_T),
                  S^T <- exp2(G_last) S^T + (v_new^T exp2(G_last - G)) k:
                  three dependent products, every left operand in registers.
    WG1 (output): Ag from T0 in place (its SMEM stage), P = (q k^T) * D while WG0 works, then
                  o = scale (Gamma (q S) + P v_new) from the published tiles; TMA-stores o.
    WG2 (memory): TMA loads of q, k, v, T0 and the gate vectors into two or three stages
                  (plan(): three at K = 128 with v^T by the transposed load).
Barriers: in_bar (a stage landed), in_free (WG0 and WG1 done with a stage), ag_ready (Ag
written over T0), s_ready / s_free (published S^T and v_new^T written / read by WG1), seq_bar
(each warpgroup's row of the sequence table), done (the three finish together).

Every product on wgmma with fp32 accumulation and 16-bit operands (S^T, X^T, v_new^T and Ag in
the input dtype, as the one-warpgroup kernel keeps S^T and v_new). Takes K <= MAX_K (the
stages of K = 256 do not fit shared memory: mosaic_fwd_kernel.py takes those). With
`residuals` (training) the state warpgroup also TMA-stores the S^T and v_new^T tiles it
publishes: the chunk states and v_new the backward reads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.serial import (carried_state, sequence_range, store_final_state,
                                    store_output)
from ..common.mosaic.tiles import (COLS, F32, ROWS, WGMMA, build, causal_decay, cols_of,
                                   iota, load, load_transposed, matmul, matmuls, rows_of,
                                   smem_tile, transposed_load_lowers, union)
from ..common.mosaic.warpgroups import (finish_together, observe_last, registers,
                                        stream_stages)
from .mosaic_fwd_kernel import BV, C, TABLE_WIDTH

MAX_K = 128
MAX_STAGES = 3          # input stages, as many as fit SMEM_BUDGET up to this (plan())
APPROX_MATH = True      # ex2.approx for the decays (~2 ulp; RESULTS.md run 20 call 9: with the
                        # backward kernels' the GDN step 0.978 -> 0.895 ms, parity 0 failed)
SMEM_BUDGET = 220 * 1024
# v^T for X^T by a product with the identity (True) or by a transposed register load of v's
# tile (False, the default; lowers under jax >= 0.11 only: older jax takes the identity
# regardless). Both GPU-proven (RESULTS.md run 20). The load frees the identity's 8 KB of
# shared memory, which lets K = 128 take a third input stage.
IDENTITY_V_T = False
# The update's decay exp2(G_last - G) from the chunk's G already in registers, in this kernel
# and the split's map pass (mosaic_map_ws.py) (True: no forward kernel reads a G_last - G
# vector, so XLA drops its slice and multiply kernels: RESULTS.md run 28 put the GDN B4 T4096
# forward's glue at 4 kernels, 10.2 us, against jla's 3, 7.1) or from the G_last - G vector
# (False, the default, GPU-proven). The same fp32 difference either way
# (mosaic_layout.LATER="difference" forms it in XLA), rounded after the log2(e) scale instead
# of before. Opt-in until a GPU parity run and a profile decide.
LATER_IN_KERNEL = False


def plan(K: int, dtype) -> tuple[int, bool]:
    """(input stages, identity tile for v^T) of the kernel at head size K: the identity where
    IDENTITY_V_T asks for it or the transposed load does not lower, then the most stages (2 to
    MAX_STAGES) within SMEM_BUDGET (0 when even 2 do not fit). The training forward too: two
    stages there timed the same as three (RESULTS.md run 23 calls 1 and 3)."""
    eye = bool(IDENTITY_V_T) or not transposed_load_lowers()
    for stages in range(MAX_STAGES, 1, -1):
        if smem_bytes(K, dtype, stages, eye) <= SMEM_BUDGET:
            return stages, eye
    return 0, eye


def smem_bytes(K: int, dtype, stages: int | None = None, eye: bool | None = None) -> int:
    """Shared memory of the kernel (each buffer rounded up to 1 KB, as Mosaic aligns them);
    stages / eye default to plan()'s (2 stages where none fit)."""
    if stages is None or eye is None:
        planned, planned_eye = plan(K, dtype)
        stages = max(planned, 2) if stages is None else stages
        eye = planned_eye if eye is None else eye
    isz = jnp.dtype(dtype).itemsize
    kb = lambda n: -(-n // 1024) * 1024          # noqa: E731
    per_stage = 2 * kb(C * K * isz) + kb(C * BV * isz) + kb(C * C * isz)
    vectors = 5 * kb(stages * C * 4)
    # the published S^T pair (sharing memory with the fp32 state in / out), v_new^T and o
    # pairs, the identity, the table rows
    fixed = (max(2 * kb(BV * K * isz), kb(BV * K * 4)) + 4 * kb(C * BV * isz)
             + (kb(C * C * isz) if eye else 0) + kb(3 * TABLE_WIDTH * 4))
    return stages * per_stage + vectors + fixed


# The per-chunk gate vectors of the warp-specialized delta-family kernels (this forward and
# mosaic_bwd_states_ws.py), one stage buffer per reader and register layout (one buffer read
# as rows and as columns fails Mosaic's layout inference on jax 0.11.2): WG0 G (columns, G_0,
# G_last) and G_last - G; WG1 G as rows and as columns, beta
GATE_VECTORS = ("g0_s", "s0_s", "g1r_s", "g1c_s", "b1_s")


def gate_vector_scratch(stages: int, later: bool = True) -> dict:
    """The GATE_VECTORS stage buffers, fp32 [stages, C] each; without `later` no s0_s (the
    update decay then comes from G: update_decay)."""
    return {name: plgpu.SMEM((stages, C), F32) for name in GATE_VECTORS
            if later or name != "s0_s"}


def update_decay(s0_s, slot, g_last, g_col):
    """exp2(G_last - G) [C] (COLS) of the state update: from the stage's G_last - G vector, or
    without one (s0_s None, LATER_IN_KERNEL) from G's columns g_col and G_last."""
    if s0_s is None:
        return jnp.exp2(g_last - g_col)
    return jnp.exp2(load(s0_s.at[slot], COLS))


def copy_gate_vectors(gc_ref, gs_ref, b_ref, bufs, hv, rows, slot, bar):
    """TMA copies of one chunk's G, G_last - G and beta rows (gc_ref, gs_ref, b_ref [HV, R]
    fp32) into stage `slot` of bufs (the GATE_VECTORS buffers, in that order; a None buffer,
    with gs_ref None for s0_s, is skipped), arriving at bar: one arrival per buffer."""
    for src, dst in zip((gc_ref, gs_ref, gc_ref, gc_ref, b_ref), bufs):
        if dst is not None:
            plgpu.copy_gmem_to_smem(src.at[hv, rows], dst.at[slot], bar)


def ag_over_t0(t_tile, beta_vec, d):
    """Ag = (T0 * D) diag(beta) written over the T0 tile t_tile [C, C] (16-bit SMEM), from
    the decay tile D (fp32, WGMMA layout) and beta_vec [C] fp32 (SMEM); no commit."""
    ag = load(t_tile, WGMMA).astype(F32) * d * cols_of(load(beta_vec, COLS), d.shape)
    t_tile[...] = ag.astype(t_tile.dtype)


def supports(K: int, dtype) -> bool:
    return K <= MAX_K and plan(K, dtype)[0] >= 2


def fused_forward_ws(q, k, v, t0, gcum, gsuf, beta, table, h0t, *, scale: float,
                     residuals: bool = False):
    """q, k: [R, H, K] (16-bit, one dtype; R a multiple of 64, every sequence starting at a
    chunk boundary, padding rows zero); v: [R, HV, V] (q's dtype, V a multiple of 64); t0:
    [HV, R, C] (q's dtype: mosaic_kkt.gate_free_inverse_mosaic without the WY factors); gcum,
    gsuf, beta: [HV, R] fp32 (G, G_last - G in log2 units; beta; gsuf unread, may be None,
    with LATER_IN_KERNEL; gcum and gsuf None: the delta rule, no decay, whose kernel neither
    reads gate vectors nor scales by them); table: [N, TABLE_WIDTH] int32
    (column 0: first chunk of sequence n, column 1: its chunk count); h0t: None or
    [N, HV, V, K] fp32 (transposed initial states). Value head hv reads key head hv // (HV // H).
    Returns o [R, HV, V] in q's dtype and the transposed final states [N, HV, V, K] fp32; with
    `residuals` also the transposed state entering each chunk hs [R // C, HV, V, K] and v_new^T
    [HV, V, R], both in q's dtype (the state warpgroup TMA-stores the tiles it publishes), as
    mosaic_fwd_kernel.fused_forward's residuals."""
    R, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    group = HV // H
    N = table.shape[0]
    dt = q.dtype
    has_h0 = h0t is not None
    if not supports(K, dt) or V % BV:
        raise ValueError(f"fused_forward_ws: K={K}, V={V}, {jnp.dtype(dt).name}; expected "
                         f"K <= {MAX_K} and V a multiple of {BV}")
    S, eye = plan(K, dt)
    gated = gcum is not None
    later_in_kernel = bool(LATER_IN_KERNEL) or not gated
    gates = gate_vector_scratch(S, later=not later_in_kernel) if gated else {
        "b1_s": plgpu.SMEM((S, C), F32)}
    scratch = dict(
        q_s=smem_tile((S, C, K), dt), k_s=smem_tile((S, C, K), dt),
        v_s=smem_tile((S, C, BV), dt), t_s=smem_tile((S, C, C), dt),
        **gates,
        # the published S^T pair; the fp32 state before the first / after the last chunk
        pub_st=union(smem_tile((2, BV, K), dt), smem_tile((BV, K), F32)),
        vn_pub=smem_tile((2, BV, C), dt), o_s=smem_tile((2, C, BV), dt),
        seq_s=plgpu.SMEM((3, TABLE_WIDTH), jnp.int32),
        # one arrival per TMA copy: 4 tiles and the gate vectors
        in_bar=plgpu.Barrier(num_arrivals=4 + len(gates), num_barriers=S),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=S),
        ag_ready=plgpu.Barrier(num_arrivals=1, num_barriers=S),
        s_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        s_free=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        one_bar=plgpu.Barrier(num_arrivals=1, num_barriers=1),
        seq_bar=plgpu.Barrier(num_arrivals=1, num_barriers=3),
        done=plgpu.Barrier(num_arrivals=3, num_barriers=1),
    )
    if eye:     # WG0: the identity (v^T by a product)
        scratch.update(eye_s=smem_tile((C, C), dt))
    out_type = [jax.ShapeDtypeStruct((R, HV, V), dt), jax.ShapeDtypeStruct((N, HV, V, K), F32)]
    if residuals:
        out_type += [jax.ShapeDtypeStruct((R // C, HV, V, K), dt),
                     jax.ShapeDtypeStruct((HV, V, R), dt)]

    def body(*refs, q_s, k_s, v_s, t_s, b1_s, pub_st, vn_pub, o_s, seq_s, in_bar, in_free,
             ag_ready, s_ready, s_free, one_bar, seq_bar, done, eye_s=None, g0_s=None,
             g1r_s=None, g1c_s=None, s0_s=None):
        s_pub, st_s = pub_st
        refs = list(refs)
        q_ref, k_ref, v_ref, t_ref = (refs.pop(0) for _ in range(4))
        gc_ref = refs.pop(0) if gated else None
        gs_ref = None if later_in_kernel else refs.pop(0)
        b_ref, tab_ref = refs.pop(0), refs.pop(0)
        h0_ref = refs.pop(0) if has_h0 else None
        o_ref, ht_ref = refs[:2]
        hs_ref, vn_ref = refs[2:] if residuals else (None, None)
        n, hv, iv = lax.axis_index("n"), lax.axis_index("hv"), lax.axis_index("v")
        wg = lax.axis_index("wg")
        h = lax.div(hv, group)
        cols = pl.ds(iv * BV, BV)

        def bounds():
            """(first chunk, chunk count) of sequence n: each warpgroup reads its own row."""
            return sequence_range(tab_ref, n, seq_s.at[wg], seq_bar.at[wg])

        @pl.when(wg == 2)
        def _memory():
            registers(40, "decrease")
            first, count = bounds()

            def issue(c, slot):
                rows, bar = pl.ds((first + c) * C, C), in_bar.at[slot]
                plgpu.copy_gmem_to_smem(q_ref.at[rows, h], q_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(v_ref.at[rows, hv, cols], v_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(t_ref.at[hv, rows], t_s.at[slot], bar)
                copy_gate_vectors(gc_ref, gs_ref, b_ref, (g0_s, s0_s, g1r_s, g1c_s, b1_s), hv,
                                  rows, slot, bar)

            stream_stages(count, S, in_free, issue)

        @pl.when(wg == 0)
        def _state():
            registers(232, "increase")
            first, count = bounds()
            s0 = carried_state(h0_ref.at[n, hv, cols] if has_h0 else None, st_s, one_bar.at[0],
                               (BV, K))
            tile = (BV, C)
            if eye_s is not None:
                eye_s[...] = jnp.where(iota((C, C), 0) == iota((C, C), 1), 1.0,
                                       0.0).astype(dt)
                plgpu.commit_smem()

            def step(c, s_t):
                slot, half = lax.rem(c, S), lax.rem(c, 2)
                plgpu.barrier_wait(in_bar.at[slot])

                @pl.when(c >= 2)
                def _():      # WG1 has read the tiles published two chunks ago
                    plgpu.barrier_wait(s_free.at[half])

                if residuals:   # the store of chunk c - 2's S^T has read s_pub[half] (the
                    # three stores issued after it may still run)
                    plgpu.wait_smem_to_gmem(3, wait_read_only=True)
                s_lo = s_t.astype(dt)
                s_pub.at[half][...] = s_lo
                if residuals:
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(s_pub.at[half], hs_ref.at[first + c, hv, cols])
                if gated:
                    g_col = load(g0_s.at[slot], COLS)
                    g_last = g0_s[slot, C - 1]
                    # the update's decay exp2(G_last - G) formed now, off the chain: loaded
                    # after the v_new product it waited behind that product's wgmma wait
                    # (kernel-only H100 B4 T4096: 125.6 -> 119.0 us, RESULTS.md run 22 call 4)
                    k_decay = update_decay(s0_s, slot, g_last, g_col)
                if eye_s is None:     # v^T by a transposed register load (jax >= 0.11)
                    sk = matmul(s_lo, k_s.at[slot], tile, tb=True)
                    v_t = load_transposed(v_s.at[slot]).astype(F32)
                else:   # S^T k^T and v^T = v^T I (the transposed load does not lower), one wait
                    sk, v_t = matmuls((s_lo, k_s.at[slot], tile, None, False, True),
                                      (v_s.at[slot], eye_s, tile, None, True, False))
                if gated:
                    sk = sk * cols_of(jnp.exp2(g_col), tile)
                x = (v_t - sk).astype(dt)                                       # X^T
                plgpu.barrier_wait(ag_ready.at[slot])
                vn = matmul(x, t_s.at[slot], tile, tb=True)                     # v_new^T
                if residuals:   # the store of chunk c - 2's v_new^T has read vn_pub[half]
                    plgpu.wait_smem_to_gmem(3, wait_read_only=True)
                vn_lo = vn.astype(dt)
                vn_pub.at[half][...] = vn_lo
                plgpu.commit_smem()
                plgpu.barrier_arrive(s_ready.at[half])
                if residuals:
                    plgpu.copy_smem_to_gmem(vn_pub.at[half],
                                            vn_ref.at[hv, cols, pl.ds((first + c) * C, C)])
                if gated:
                    vd = (vn * cols_of(k_decay, tile)).astype(dt)
                    s_new = matmul(vd, k_s.at[slot], (BV, K), init=s_t * jnp.exp2(g_last))
                else:
                    s_new = matmul(vn_lo, k_s.at[slot], (BV, K), init=s_t)
                plgpu.barrier_arrive(in_free.at[slot])
                return s_new

            s_t = lax.fori_loop(0, count, step, s0)

            observe_last(count, 2, s_free)    # WG1's reads of the last two published tiles
            if residuals:     # the residual stores have read s_pub (st_s shares its memory)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            store_final_state(st_s, s_t, ht_ref.at[n, hv, cols])

        @pl.when(wg == 1)
        def _output():
            registers(232, "increase")
            first, count = bounds()
            sq = (C, C)

            def step(c, carry):
                slot, half = lax.rem(c, S), lax.rem(c, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                if gated:
                    g_row = load(g1r_s.at[slot], ROWS)
                    d = causal_decay(g_row, load(g1c_s.at[slot], COLS), sq)
                else:     # no decay: the causal mask
                    d = jnp.where(iota(sq, 0) >= iota(sq, 1), 1.0, 0.0)
                ag_over_t0(t_s.at[slot], b1_s.at[slot], d)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ag_ready.at[slot])
                p = matmul(q_s.at[slot], k_s.at[slot], sq, tb=True)
                p_lo = (p * d).astype(dt)
                plgpu.barrier_wait(s_ready.at[half])
                o = matmul(q_s.at[slot], s_pub.at[half], (C, BV), tb=True)
                o = matmul(p_lo, vn_pub.at[half], (C, BV), tb=True,
                           init=o * rows_of(jnp.exp2(g_row), (C, BV)) if gated else o)
                plgpu.barrier_arrive(s_free.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                store_output(o_s, c, (o * scale).astype(dt),
                             o_ref.at[pl.ds((first + c) * C, C), hv, cols])
                return carry

            lax.fori_loop(0, count, step, None)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = ([q, k, v, t0] + ([gcum] if gated else []) + ([] if later_in_kernel else [gsuf])
            + [beta, table]
            + ([h0t] if has_h0 else []))
    kernel = build(body, name="gdn_fwd_ws", out_type=out_type, scratch=scratch,
                   grid=(N, HV, V // BV), grid_names=("n", "hv", "v"), threads=3,
                   approx_math=bool(APPROX_MATH))
    return kernel(*args)
