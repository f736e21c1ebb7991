"""Warp-specialized forward Mosaic GPU kernel of chunked simple GLA (output mode, K <= 128).

Same math and inputs as mosaic_fwd.forward (output and final state), one CTA per (sequence,
head, 64 value columns) with three warpgroups:
    WG0 (state):  the serial chain only: publishes S^T (q's dtype) of each chunk in one of two
                  SMEM tiles, then S^T <- exp2(g_l) S^T + v^T (k exp2(g_l - g2)).
    WG1 (output): P = (q k^T) * D while WG0 works, then o = scale (exp2(g2) (q S) + P v) from
                  the published tile; TMA-stores o.
    WG2 (memory): streams q, k, v and the gates of the next chunks with TMA into STAGES buffers.
Barriers: in_bar (chunk landed), in_free (both compute warpgroups done with a buffer), s_ready /
s_free (published state tile written / read), done (all warpgroups finish together).
With `states` (the training forward) WG0 also TMA-stores each published S^T tile: the state
entering every chunk, as mosaic_fwd.forward(mode="states") writes it, so the backward does not
run that pass again.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.serial import (carried_state, sequence_range, store_final_state,
                                    store_output)
from ..common.mosaic.tiles import (COLS, F32, ROWS, build, causal_decay, cols_of,
                                   load_transposed, load_vec, load_wgmma, matmul,
                                   products_during, rows_of, smem_tile, transposed_load_lowers,
                                   union)
from ..common.mosaic.warpgroups import (finish_together, observe_last, registers,
                                        stream_stages)
from .mosaic_fwd import BV, C, SEQ_COLS

SMEM_BUDGET = 220 * 1024
MAX_K = 128
# Two choices per forward, read when traced: the inference forward (output and final state)
# and the training forward (`states`: it also TMA-stores every chunk's entering state).
#   STATE_STEP "vt": the state update's left operand is v^T exp2(g_l - g2) in registers (a
#     transposed register load, jax >= 0.11; older jax takes "kd"), no SMEM round trip, and the
#     freed tile lets 4 stages fit at K = 128; "kd": the decayed keys k exp2(g_l - g2) through
#     an SMEM tile, v^T from SMEM.
#   OVERLAP: the output warpgroup forms the decay masks while q k^T runs and issues q S and
#     P v together (two accumulators, one wait) instead of one product at a time.
# H200, B4 T4096 H16 K=V=128 bf16, kernel device us (RESULTS.md run 27, kernel_profile.py;
# jla's sg_fused_fwd 78.2): inference kd 84.9-86.0, vt 84.1, OVERLAP alone 88.0, **vt +
# OVERLAP 76.3**; training kd 106.9, vt 111.6, vt + OVERLAP 110.0. GPU parity of both 0 failed.
STATE_STEP = "vt"
OVERLAP = True
TRAIN_STATE_STEP = "kd"
TRAIN_OVERLAP = False


def choices(states: bool) -> tuple[bool, bool]:
    """(vt, overlap) of the forward with or without `states`."""
    step, overlap = (TRAIN_STATE_STEP, TRAIN_OVERLAP) if states else (STATE_STEP, OVERLAP)
    if step not in ("kd", "vt"):
        raise ValueError(f"state step {step!r}; expected 'kd' or 'vt'")
    return step == "vt" and transposed_load_lowers(), bool(overlap)


def _stages(K, itemsize, vt=False):
    per = (2 * C * K + C * BV) * itemsize + 3 * C * 4
    fixed = 2 * BV * K * itemsize + (0 if vt else C * K * itemsize) + 2 * C * BV * itemsize
    fixed += 4096
    for s in (4, 3, 2):
        if s * per + fixed <= SMEM_BUDGET:
            return s
    return 0


def supports(K: int, dtype) -> bool:
    return K <= MAX_K and _stages(K, jnp.dtype(dtype).itemsize) >= 2


def forward_ws(q, k, v, g2, h0t, seq, *, scale: float, n_seqs: int, states: bool = False):
    """Arguments and returns as mosaic_fwd.forward(..., out_final=True, mode='output'); with
    `states` a third output: the transposed state entering every chunk, [Bq, H, Tp // 64, V, K]
    in q's dtype (mosaic_fwd.forward's mode='states' output; chunks no sequence covers are not
    written)."""
    Bq, Tp, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype
    varlen = seq is not None
    has_h0 = h0t is not None
    static_chunks = Tp // C
    vt, overlap = choices(states)
    S = _stages(K, jnp.dtype(dt).itemsize, vt)
    out_type = [jax.ShapeDtypeStruct((Bq, Tp, H, V), dt),
                jax.ShapeDtypeStruct((n_seqs, H, V, K), F32)]
    if states:
        out_type.append(jax.ShapeDtypeStruct((Bq, H, static_chunks, V, K), dt))
    scratch = dict(
        q_s=smem_tile((S, C, K), dt), k_s=smem_tile((S, C, K), dt),
        v_s=smem_tile((S, C, BV), dt),
        # the gates once per reader and register layout (one buffer read as rows and as
        # columns fails Mosaic layout inference on jax 0.11.2)
        g0_s=plgpu.SMEM((S, C), F32), g1_s=plgpu.SMEM((S, C), F32),
        g2_s=plgpu.SMEM((S, C), F32),
        # the published states; WG0's fp32 state before the first / after the last chunk
        pub_st=union(smem_tile((2, BV, K), dt), smem_tile((BV, K), F32)),
        **({} if vt else {"kd_s": smem_tile((C, K), dt)}),     # the decayed keys ("kd")
        o_s=smem_tile((2, C, BV), dt),
        in_bar=plgpu.Barrier(num_arrivals=6, num_barriers=S),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=S),
        s_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        s_free=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        one_bar=plgpu.Barrier(num_arrivals=1, num_barriers=1),
        seq_bar=plgpu.Barrier(num_arrivals=1, num_barriers=3),
        done=plgpu.Barrier(num_arrivals=3, num_barriers=1),
    )
    if varlen:
        scratch["seq_s"] = plgpu.SMEM((3, SEQ_COLS), jnp.int32)

    def body(*refs, q_s, k_s, v_s, g0_s, g1_s, g2_s, pub_st, o_s, in_bar, in_free, s_ready,
             s_free, one_bar, seq_bar, done, kd_s=None, seq_s=None):
        s_pub, st_s = pub_st
        refs = list(refs)
        q_ref, k_ref, v_ref, g_ref = (refs.pop(0) for _ in range(4))
        h0_ref = refs.pop(0) if has_h0 else None
        seq_ref = refs.pop(0) if varlen else None
        o_ref, ht_ref = refs[:2]
        hs_ref = refs[2] if states else None
        n, h, iv = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("v")
        wg = lax.axis_index("wg")
        v0 = iv * BV

        def bounds():    # each warpgroup reads the table into its own row
            if not varlen:
                return n, 0, static_chunks
            return (0, *sequence_range(seq_ref, n, seq_s.at[wg], seq_bar.at[wg]))

        @pl.when(wg == 2)
        def _memory():
            registers(40, "decrease")
            b, c0, nc = bounds()

            def issue(c, slot):
                rows = pl.ds((c0 + c) * C, C)
                bar = in_bar.at[slot]
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h, pl.ds(v0, BV)], v_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows], g0_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows], g1_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows], g2_s.at[slot], bar)

            stream_stages(nc, S, in_free, issue)

        @pl.when(wg == 0)
        def _state():
            registers(232, "increase")
            b, c0, nc = bounds()
            s0 = carried_state(h0_ref.at[n, h, pl.ds(v0, BV)] if has_h0 else None, st_s,
                               one_bar.at[0], (BV, K))

            def step(c, s_t):
                slot, half = lax.rem(c, S), lax.rem(c, 2)
                plgpu.barrier_wait(in_bar.at[slot])

                @pl.when(c >= 2)
                def _():     # WG1 has read the tile published two chunks ago
                    plgpu.barrier_wait(s_free.at[half])

                if states:   # and the store of that tile (chunk c - 2) has read it
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                s_pub.at[half][...] = s_t.astype(dt)
                plgpu.commit_smem()
                plgpu.barrier_arrive(s_ready.at[half])
                if states:
                    plgpu.copy_smem_to_gmem(s_pub.at[half],
                                            hs_ref.at[b, h, c0 + c, pl.ds(v0, BV)])
                g_last = g0_s[slot, C - 1]
                if vt:          # v^T exp2(g_l - g2) in registers, the product's left operand
                    v_t = load_transposed(v_s.at[slot]).astype(F32)
                    k_decay = jnp.exp2(g_last - load_vec(g0_s.at[slot], COLS))
                    vd_t = (v_t * cols_of(k_decay, (BV, C))).astype(dt)
                    s_new = matmul(vd_t, k_s.at[slot], (BV, K), init=s_t * jnp.exp2(g_last))
                else:
                    g_row = load_vec(g0_s.at[slot], ROWS)
                    k_t = load_wgmma(k_s.at[slot]).astype(F32)
                    kd_s[...] = (k_t * rows_of(jnp.exp2(g_last - g_row), (C, K))).astype(dt)
                    plgpu.commit_smem()
                    s_new = matmul(v_s.at[slot], kd_s, (BV, K), init=s_t * jnp.exp2(g_last),
                                   ta=True)
                plgpu.barrier_arrive(in_free.at[slot])
                return s_new

            s_t = lax.fori_loop(0, nc, step, s0)

            observe_last(nc, 2, s_free)    # WG1's reads of the last two published tiles
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # st_s shares s_pub's memory
            store_final_state(st_s, s_t, ht_ref.at[n, h, pl.ds(v0, BV)])

        @pl.when(wg == 1)
        def _output():
            registers(232, "increase")
            b, c0, nc = bounds()

            def step(c, carry):
                slot, half = lax.rem(c, S), lax.rem(c, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                g_row = load_vec(g1_s.at[slot], ROWS)
                g_col = load_vec(g2_s.at[slot], COLS)
                if overlap:     # the masks formed while q k^T runs; q S and P v in flight at once
                    (p,), (d, q_decay) = products_during(
                        [(q_s.at[slot], k_s.at[slot], (C, C), False, True)],
                        lambda: (causal_decay(g_row, g_col, (C, C)), jnp.exp2(g_row)))
                    p = (p * d).astype(dt)
                    plgpu.barrier_wait(s_ready.at[half])
                    (oq, pv), _ = products_during(
                        [(q_s.at[slot], s_pub.at[half], (C, BV), False, True),
                         (p, v_s.at[slot], (C, BV), False, False)])
                    o = oq * rows_of(q_decay, (C, BV)) + pv
                else:
                    p = matmul(q_s.at[slot], k_s.at[slot], (C, C), tb=True)
                    p = (p * causal_decay(g_row, g_col, (C, C))).astype(dt)
                    plgpu.barrier_wait(s_ready.at[half])
                    o = matmul(q_s.at[slot], s_pub.at[half], (C, BV), tb=True)
                    o = matmul(p, v_s.at[slot], (C, BV),
                               init=o * rows_of(jnp.exp2(g_row), (C, BV)))
                plgpu.barrier_arrive(s_free.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                store_output(o_s, c, (o * scale).astype(dt),
                             o_ref.at[b, pl.ds((c0 + c) * C, C), h, pl.ds(v0, BV)])
                return carry

            lax.fori_loop(0, nc, step, None)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = [q, k, v, g2] + ([h0t] if has_h0 else []) + ([seq] if varlen else [])
    outs = build(body, name="simple_gla_mosaic_fwd_ws", out_type=out_type, scratch=scratch,
                 grid=(n_seqs, H, V // BV), grid_names=("n", "h", "v"), threads=3,
                 approx_math=True)(*args)
    return tuple(outs)
