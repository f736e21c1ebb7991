"""Warp-specialized Mosaic GPU (sm_90) reverse state pass of the chunked gated delta rule
backward: one CTA of three warpgroups per (sequence, value head, 64 value columns), chunks in
reverse order. The same results as mosaic_bwd_kernel.py (the one-warpgroup pass), from the
gate-free inverse T0 instead of the WY keys -W' (which the forward's T0 kernel then does not
form: 8 KB read per chunk and head instead of 16 KB, and no -W' written).

With L^T [BV, K] fp32 the cotangent of the state leaving the current chunk (dht at the
sequence's end), G the chunk-local gate cumsum (log2 units), D_ij = exp2(G_i - G_j) (i >= j),
P = tril(q k^T) * D, Ag = (T0 * D) diag(beta), Gamma' = exp2(G - G_0) (relative to the chunk's
first row) and the forward's WY keys w' = Ag (Gamma' k):
    dv_new^T = scale do^T P + (L^T k^T) exp2(G_last - G)
    L^T     <- exp2(G_last) L^T + exp2(G_0) (do^T (scale Gamma' q) - (dv_new^T Ag) (Gamma' k))
(mosaic_bwd_kernel.py's update with dv_new^T w' taken as (dv_new^T Ag) (Gamma' k): the product
dv_new^T Ag is rounded to the activations' dtype where that kernel read w' rounded).
    WG0 (state):  L^T in fp32 registers: stores L^T (the chunk's dh) and dv_new^T, and runs
                  L^T k^T, dv_new^T, dv_new^T Ag and the update: four dependent products.
    WG1 (prep):   one stage ahead of WG0, from the inputs alone: P (scaled) into its own stage
                  buffer, Gamma' k too, Ag over T0 and scale Gamma' q over q in their stages.
    WG2 (memory): TMA loads of q, k, do, T0 and the gate vectors into two stages.
Barriers: in_bar (a stage landed), in_free (WG0 and WG1 done with a stage), prep (WG1's tiles
of a stage written), seq_bar (each warpgroup's row of the sequence table), done.
Variants (module constants, read when traced). The defaults, GPU-proven (RESULTS.md run 27:
parity 0 failed; H200 B1 T32768 GDN step 1.977 -> 1.923 ms, delta rule 1.883 -> 1.771):
    OPERAND_SCALES = "registers": the update's row scales go on WG0's register operands instead
        of SMEM tiles: (do^T diag(scale Gamma')) q - (dv_new^T Ag diag(Gamma')) k, do^T by a
        transposed register load (jax >= 0.11; older jax takes "smem", the earlier default:
        Gamma' k as a tile WG1 writes, two stages). WG1 then forms only P and Ag; no Gamma' k
        tile, so the no-store run fits three stages (MAX_STAGES).
    DVL_IN_PREP = True: WG1 also forms do^T P (rounded to q's dtype, over P), so WG0's chain
        has three dependent products instead of four. Only with "registers" scales: with
        "smem" ones and two stages it was slower on an H200 (287.9 -> 300.7 us at B1 T32768,
        RESULTS.md run 26).
Outputs as mosaic_bwd_kernel.reverse_states: dh [R // C, HV, V, K] (L^T per chunk before its
update), dvnT [HV, V, R] (both in q's dtype) and dh0T [N, HV, V, K] fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.serial import carried_state, sequence_range
from ..common.mosaic.tiles import (COLS, F32, ROWS, WGMMA, build, causal_decay, cols_of, load,
                                   load_transposed, matmul, rows_of, smem_tile,
                                   transposed_load_lowers, union, zeros_wgmma)
from ..common.mosaic.warpgroups import finish_together, registers, stream_stages
from .mosaic_bwd_kernel import chain
from .mosaic_fwd_kernel import BV, C, TABLE_WIDTH
from .mosaic_fwd_ws import ag_over_t0, copy_gate_vectors, gate_vector_scratch

MAX_K = 128
STAGES = 2              # with "smem" scales; plan() takes up to MAX_STAGES with "registers"
MAX_STAGES = 3
APPROX_MATH = True      # ex2.approx for the decays (as mosaic_bwd_grads.APPROX_MATH)
SMEM_BUDGET = 220 * 1024
OPERAND_SCALES = "registers"    # or "smem" (see the module docstring)
DVL_IN_PREP = True              # with "registers" scales only (see the module docstring)


def scales_mode() -> str:
    """OPERAND_SCALES where it lowers ("registers" needs the transposed register load)."""
    if OPERAND_SCALES not in ("smem", "registers"):
        raise ValueError(f"OPERAND_SCALES={OPERAND_SCALES!r}; expected 'smem' or 'registers'")
    return OPERAND_SCALES if transposed_load_lowers() else "smem"


def smem_bytes(K: int, dtype, stages: int = STAGES, mode: str = "smem",
               store: bool = True) -> int:
    """Shared memory of the kernel (each buffer rounded up to 1 KB, as Mosaic aligns them)."""
    isz = jnp.dtype(dtype).itemsize
    kb = lambda n: -(-n // 1024) * 1024          # noqa: E731
    # q (then scale Gamma' q), k, Gamma' k ("smem" scales only), do, T0 (then Ag), P
    tiles = 3 if mode == "smem" else 2
    per_stage = tiles * kb(C * K * isz) + kb(C * BV * isz) + 2 * kb(C * C * isz)
    vectors = 5 * kb(stages * C * 4)
    # L^T fp32 (dht in, dh0 out) sharing memory with the two-slot output tiles L^T and dv_new^T
    # (never live together; no output tiles without `store` in "registers" mode), the table rows
    outs = 2 * kb(BV * K * isz) + 2 * kb(BV * C * isz) if store or mode == "smem" else 0
    fixed = max(kb(BV * K * 4), outs) + kb(3 * TABLE_WIDTH * 4)
    return stages * per_stage + vectors + fixed


def plan(K: int, dtype, store: bool) -> tuple[int, str]:
    """(input stages, scales mode): STAGES with "smem" scales; with "registers" the most stages
    up to MAX_STAGES within SMEM_BUDGET (at least STAGES: it needs less SMEM than "smem", whose
    STAGES supports() has checked)."""
    mode = scales_mode()
    if mode == "registers":
        for stages in range(MAX_STAGES, STAGES, -1):
            if smem_bytes(K, dtype, stages, mode, store) <= SMEM_BUDGET:
                return stages, mode
    return STAGES, mode


def supports(K: int, dtype) -> bool:
    return K <= MAX_K and smem_bytes(K, dtype) <= SMEM_BUDGET


def reverse_states_ws(q, k, t0, do, gcum, gsuf, beta, table, dhtT, *, scale: float,
                      group: int, store: bool = True):
    """q, k: [R, H, K]; t0: [HV, R, C] (the gate-free inverse); do: [R, HV, V], all in one
    16-bit dtype; gcum, gsuf, beta: [HV, R] fp32 (G and G_last - G in log2 units; beta);
    table: [N, TABLE_WIDTH] int32 as in the forward; dhtT: None or [N, HV, V, K] fp32.
    Returns dh [R // C, HV, V, K] (L^T per chunk), dvnT [HV, V, R] (both in q's dtype) and
    dh0T [N, HV, V, K] fp32; without `store` only dh0T (the sequence split's pass from a zero
    end gradient, mosaic_pieces.py: the same chunk loop, no tile stored)."""
    R, _, K = q.shape
    HV, V = do.shape[1], do.shape[2]
    N = table.shape[0]
    dt = q.dtype
    has_dht = dhtT is not None
    if not supports(K, dt) or V % BV:
        raise ValueError(f"reverse_states_ws: K={K}, V={V}, {jnp.dtype(dt).name}; expected "
                         f"K <= {MAX_K} and V a multiple of {BV}")
    S, mode = plan(K, dt, store)
    regs = mode == "registers"
    dvl_prep = regs and bool(DVL_IN_PREP)
    scratch = dict(
        q_s=smem_tile((S, C, K), dt), k_s=smem_tile((S, C, K), dt),
        do_s=smem_tile((S, C, BV), dt),
        t_s=smem_tile((S, C, C), dt), p_s=smem_tile((S, C, C), dt),
        **gate_vector_scratch(S),           # as mosaic_fwd_ws.py's (WG1 also reads G_0)
        # L^T fp32 only before and after the chunk loop; the output tiles only inside it
        outs=(union(smem_tile((BV, K), F32),
                    (smem_tile((2, BV, K), dt), smem_tile((2, BV, C), dt)))
              if store or not regs else smem_tile((BV, K), F32)),
        seq_s=plgpu.SMEM((3, TABLE_WIDTH), jnp.int32),
        in_bar=plgpu.Barrier(num_arrivals=9, num_barriers=S),     # 9 TMA copies
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=S),
        prep=plgpu.Barrier(num_arrivals=1, num_barriers=S),
        one_bar=plgpu.Barrier(num_arrivals=1, num_barriers=1),
        seq_bar=plgpu.Barrier(num_arrivals=1, num_barriers=3),
        done=plgpu.Barrier(num_arrivals=3, num_barriers=1),
    )
    out_type = [jax.ShapeDtypeStruct((R // C, HV, V, K), dt),
                jax.ShapeDtypeStruct((HV, V, R), dt)] if store else []
    out_type += [jax.ShapeDtypeStruct((N, HV, V, K), F32)]

    if not regs:
        scratch["kg_s"] = smem_tile((S, C, K), dt)

    def body(*refs, q_s, k_s, do_s, t_s, p_s, g0_s, s0_s, g1r_s, g1c_s, b1_s, outs,
             seq_s, in_bar, in_free, prep, one_bar, seq_bar, done, kg_s=None):
        l_s, (lo_s, dv_s) = outs if store or not regs else (outs, (None, None))
        refs = list(refs)
        q_ref, k_ref, t_ref, do_ref, gc_ref, gs_ref, b_ref, tab_ref = (refs.pop(0)
                                                                       for _ in range(8))
        dht_ref = refs.pop(0) if has_dht else None
        dh_ref, dv_ref, dh0_ref = refs if store else (None, None, refs[0])
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

            def issue(i, slot):     # the i-th chunk from the sequence's end
                rows, bar = pl.ds((first + count - 1 - i) * C, C), in_bar.at[slot]
                plgpu.copy_gmem_to_smem(q_ref.at[rows, h], q_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(do_ref.at[rows, hv, cols], do_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(t_ref.at[hv, rows], t_s.at[slot], bar)
                copy_gate_vectors(gc_ref, gs_ref, b_ref, (g0_s, s0_s, g1r_s, g1c_s, b1_s), hv,
                                  rows, slot, bar)

            stream_stages(count, S, in_free, issue)

        @pl.when(wg == 1)
        def _prep():
            registers(232, "increase")
            _, count = bounds()
            sq = (C, C)

            def step(i, carry):
                slot = lax.rem(i, S)
                plgpu.barrier_wait(in_bar.at[slot])
                g_row = load(g1r_s.at[slot], ROWS)
                d = causal_decay(g_row, load(g1c_s.at[slot], COLS), sq)
                p = matmul(q_s.at[slot], k_s.at[slot], sq, tb=True)
                p_s.at[slot][...] = (p * d * scale).astype(dt)
                if dvl_prep:    # do^T P [BV, C] over P (the product waited for: P was read)
                    plgpu.commit_smem()
                    p_s.at[slot][...] = matmul(do_s.at[slot], p_s.at[slot], (BV, C),
                                               ta=True).astype(dt)
                ag_over_t0(t_s.at[slot], b1_s.at[slot], d)
                if not regs:
                    rel = rows_of(jnp.exp2(g_row - g1r_s[slot, 0]), (C, K))       # Gamma'
                    kg_s.at[slot][...] = (load(k_s.at[slot], WGMMA).astype(F32)
                                          * rel).astype(dt)
                    # scale Gamma' q over q (q k^T above has been waited for)
                    q_s.at[slot][...] = (load(q_s.at[slot], WGMMA).astype(F32)
                                         * (rel * scale)).astype(dt)
                plgpu.commit_smem()
                plgpu.barrier_arrive(prep.at[slot])
                plgpu.barrier_arrive(in_free.at[slot])
                return carry

            lax.fori_loop(0, count, step, None)

        @pl.when(wg == 0)
        def _state():
            registers(232, "increase")
            first, count = bounds()
            l0 = carried_state(dht_ref.at[n, hv, cols] if has_dht else None, l_s,
                               one_bar.at[0], (BV, K))
            tile = (BV, C)

            def step(i, l_t):
                slot, half = lax.rem(i, S), lax.rem(i, 2)
                c = first + count - 1 - i
                plgpu.barrier_wait(in_bar.at[slot])
                l_lo = l_t.astype(dt)
                # the decays before the first product (loaded after it, they waited behind its
                # wgmma wait: mosaic_fwd_ws's k_decay)
                kd = jnp.exp2(load(s0_s.at[slot], COLS))
                g_first, g_last = g0_s[slot, 0], g0_s[slot, C - 1]
                if store:   # the stores of chunk i - 2 have read this half (two stores per
                    # chunk: the three issued after the first of them may still run)
                    plgpu.wait_smem_to_gmem(3, wait_read_only=True)
                    lo_s.at[half][...] = l_lo
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(lo_s.at[half], dh_ref.at[c, hv, cols])
                if regs:    # do^T diag(scale Gamma') (Gamma' = exp2(G - G_0)), off the chain
                    gam = jnp.exp2(load(g0_s.at[slot], COLS) - g_first)
                    do_sc = (load_transposed(do_s.at[slot]).astype(F32)
                             * cols_of(gam * scale, tile)).astype(dt)
                lk = matmul(l_lo, k_s.at[slot], tile, tb=True)                 # L^T k^T
                plgpu.barrier_wait(prep.at[slot])
                if dvl_prep:
                    dvn = lk * cols_of(kd, tile) + load(p_s.at[slot], WGMMA).astype(F32)
                else:
                    dvn = matmul(do_s.at[slot], p_s.at[slot], tile,
                                 init=lk * cols_of(kd, tile), ta=True)          # dv_new^T
                dvn_lo = dvn.astype(dt)
                if store:
                    plgpu.wait_smem_to_gmem(3, wait_read_only=True)
                    dv_s.at[half][...] = dvn_lo
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dv_s.at[half],
                                            dv_ref.at[hv, cols, pl.ds(c * C, C)])
                y = matmul(dvn_lo, t_s.at[slot], tile)                          # dv_new^T Ag
                if regs:
                    upd = chain(zeros_wgmma((BV, K)), (do_sc, q_s.at[slot]),
                                ((-(y * cols_of(gam, tile))).astype(dt), k_s.at[slot]),
                                shape=(BV, K))
                else:
                    upd = chain(zeros_wgmma((BV, K)), (do_s.at[slot], q_s.at[slot], True),
                                ((-y).astype(dt), kg_s.at[slot]), shape=(BV, K))
                plgpu.barrier_arrive(in_free.at[slot])
                return l_t * jnp.exp2(g_last) + upd * jnp.exp2(g_first)

            l_t = lax.fori_loop(0, count, step, l0)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            l_s[...] = l_t
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(l_s, dh0_ref.at[n, hv, cols])
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = [q, k, t0, do, gcum, gsuf, beta, table] + ([dhtT] if has_dht else [])
    kernel = build(body, name="gdn_bwd_states_ws" if store else "gdn_bwd_states_ws_nostore",
                   out_type=out_type, scratch=scratch,
                   grid=(N, HV, V // BV), grid_names=("n", "hv", "v"), threads=3,
                   approx_math=bool(APPROX_MATH))
    return kernel(*args)
