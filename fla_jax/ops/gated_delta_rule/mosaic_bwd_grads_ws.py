"""The per-chunk gradient kernel of mosaic_bwd_grads.py with two warpgroups per CTA (the
default, mosaic_bwd_grads.WARPGROUPS = 2). Same math, same inputs and outputs; the chunk's work
is split so that each warpgroup holds about half of the live tiles (the one-warpgroup kernel
spills at 255 registers) and the two run their products and element-wise work in parallel:

  warpgroup A (the q / v side): P, dq (stored), -dv_new S^T; after the states are read (X1)
      Tg, Ag, Ag Gamma' into SMEM (X2); dXu, dv (stored), U; after X3 dA, B, its row sums and
      beta B into SMEM (X4).
  warpgroup B (the k side): P^T, the state part of dk, k . dk_state, <S, L>, scale P^T q; after
      X2 dXw, W'; after X3 dA^T, (beta B)^T; after X4 the last two dk products, then dk, dbeta
      and the gate rows (its sums plus A's, read from SMEM) are stored.

X1..X4 are mbarriers: X1 and X3 both warpgroups arrive at and wait on, X2 and X4 A arrives at
and B waits on. Every register -> SMEM store that the other warpgroup or a wgmma / TMA reads
is fenced (commit_smem) before the arrive.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.tiles import (COLS, F32, ROWS, WGMMA, build, cols_of, load, matmul,
                                   rows_of)
from .mosaic_bwd_grads import (decay_fns, dq_stage, inverse_stage, issue_loads, mm,
                               out_type_of, scratch_of, store_last)
from . import mosaic_bwd_grads
from .mosaic_bwd_kernel import chain
from .mosaic_fwd_kernel import C


def chunk_grads_ws(q, k, v, do, t0, hs, dh, vnT, dvnT, gcum, gsuf, beta, *, scale: float,
                   group: int, gated: bool):
    """As mosaic_bwd_grads.chunk_grads (arguments, returns, K, V <= 128)."""
    R, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    dt = q.dtype
    sq = (C, C)
    T, F = True, False
    sync = lambda n: plgpu.Barrier(num_arrivals=n, num_barriers=1)
    scratch = scratch_of(K, V, dt, with_bb=True, r1a_s=plgpu.SMEM((C,), F32),
                         dba_s=plgpu.SMEM((C,), F32), x1=sync(2), x2=sync(1), x3=sync(2),
                         x4=sync(1), done=sync(2))

    def body(*refs, q_s, k_s, v_s, do_s, t_s, tg_s, ag_s, agk_s, st, vn, dq_o, g_r, g_c,
             s_r, b_r, b_c, db_o, r1_o, r2_o, bar, r1a_s, dba_s, x1, x2, x3, x4, done):
        dq_o, bb_s = dq_o           # beta B takes the dq staging tile once dq is stored
        dq_ref, dk_ref, dv_ref, db_ref = refs[12:16]
        r1_ref, r2_ref = refs[16:18] if gated else (None, None)
        (h_s, dh_s), (dw_s, dxw_s, dxu_s, u_s) = st
        (vn_s, dvn_s), (dv_o, dk_o) = vn
        c, hv, wg = lax.axis_index("c"), lax.axis_index("hv"), lax.axis_index("wg")
        rows = pl.ds(c * C, C)

        @pl.when(wg == 0)
        def _():
            issue_loads(refs[:12], dict(q_s=q_s, k_s=k_s, v_s=v_s, do_s=do_s, t_s=t_s, st=st,
                                        vn=vn, g_r=g_r, g_c=g_c, s_r=s_r, b_r=b_r, b_c=b_c,
                                        bar=bar), c, hv, lax.div(hv, group))
        plgpu.barrier_wait(bar.at[0])

        dec, strict = decay_fns(g_r, g_c)
        beta_r = load(b_r, ROWS)
        g_first, g_last = g_r[0], g_r[C - 1]
        gam = jnp.exp2(load(g_r, ROWS))                                 # Gamma (rows)
        e0 = jnp.exp2(g_first)

        def meet(b):
            plgpu.barrier_arrive(b.at[0])
            plgpu.barrier_wait(b.at[0])

        @pl.when(wg == 0)
        def _q_side():
            r1 = dq_stage(q_s, k_s, do_s, vn_s, h_s, dq_o, dq_ref.at[rows, hv], dec, strict,
                          gam, scale=scale, gated=gated)
            dw = matmul(dvn_s, h_s, (C, K), ta=True)                     # -dw = dv_new S^T
            meet(x1)                      # both have read the states: their SMEM is reused
            inverse_stage(dw, t_s, tg_s, ag_s, agk_s, dw_s, b_c, g_c, g_first, dec)
            plgpu.barrier_arrive(x2.at[0])
            dxu = matmul(tg_s, dvn_s, (C, V), ta=True, tb=True)          # Tg^T dv_new
            db = jnp.sum(load(v_s, WGMMA).astype(F32) * dxu, axis=1)
            dxu_s[...] = dxu.astype(dt)
            dv_o[...] = (dxu * rows_of(beta_r, (C, V))).astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dv_o, dv_ref.at[rows, hv])
            u_s[...] = matmul(ag_s, v_s, (C, V)).astype(dt)
            plgpu.commit_smem()
            meet(x3)                      # dXu, U (here) and dXw, W' (the k side) in SMEM
            x, kk = mm((dxw_s, dw_s, sq, None, F, T), (k_s, k_s, sq, None, F, T))
            da = matmul(dxu_s, u_s, sq, tb=True, init=x * e0)            # -dA
            bm = jnp.where(strict(), -da * dec(), 0.0)
            db = db + jnp.sum(bm * kk, axis=1)
            bb = bm * rows_of(beta_r, sq)                                # beta B
            if gated:
                r1a_s[...] = r1 + jnp.sum(bb * kk, axis=1)
            dba_s[...] = db
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # dq_o (and dv_o) read
            bb_s[...] = bb.astype(dt)
            plgpu.commit_smem()
            plgpu.barrier_arrive(x4.at[0])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _k_side():
            p_t, dk, kq = mm((vn_s, do_s, sq, None, T, T), (vn_s, dh_s, (C, K), None, T, F),
                             *([(k_s, q_s, sq, None, F, T)] if gated else []), pad=3)
            p_t = p_t * dec(True)                                        # P^T
            dk = dk * rows_of(jnp.exp2(load(s_r, ROWS)), (C, K))         # dk_state
            r1 = r2 = hdh = None
            if gated:
                r1 = -jnp.sum(jnp.where(strict(True), p_t * kq * scale, 0.0), axis=1)
                r2 = jnp.sum(load(k_s, WGMMA).astype(F32) * dk, axis=1)
                hdh = jnp.zeros((), F32)
                for i in range(V // 64):      # <S, L> in 64-row slices
                    sl = pl.ds(i * 64, 64)
                    hdh = hdh + jnp.sum(jnp.sum(load(h_s.at[sl], WGMMA).astype(F32)
                                                * load(dh_s.at[sl], WGMMA).astype(F32), axis=1))
            dk = matmul((p_t * scale).astype(dt), q_s, (C, K), init=dk)
            meet(x1)
            plgpu.barrier_wait(x2.at[0])      # dw, Tg, Ag Gamma' in SMEM
            dxw = matmul(tg_s, dw_s, (C, K), ta=True)                    # Tg^T dw
            wk = gam * jnp.sum(load(k_s, WGMMA).astype(F32) * dxw, axis=1)
            db = wk
            if gated:
                r1 = r1 + beta_r * wk
            dk = dk + dxw * rows_of(beta_r * gam, (C, K))
            dxw_s[...] = dxw.astype(dt)
            dw_s[...] = matmul(agk_s, k_s, (C, K)).astype(dt)            # W' (dw is read)
            plgpu.commit_smem()
            meet(x3)
            x_t, kk = mm((dw_s, dxw_s, sq, None, F, T), (k_s, k_s, sq, None, F, T))
            da_t = matmul(u_s, dxu_s, sq, tb=True, init=x_t * e0)        # -dA^T
            bb_t = jnp.where(strict(True), -da_t * dec(True), 0.0) * cols_of(load(b_c, COLS),
                                                                             sq)
            if gated:
                r1 = r1 - jnp.sum(bb_t * kk, axis=1)
            plgpu.barrier_wait(x4.at[0])      # beta B and the q side's row sums
            dk = chain(dk, (bb_s, k_s), (bb_t.astype(dt), k_s), shape=(C, K))
            store_last((dk_o, db_o, r1_o, r2_o), (dk_ref, db_ref, r1_ref, r2_ref), rows, hv,
                       dk.astype(dt), db + load(dba_s, ROWS),
                       None if r1 is None else r1 + load(r1a_s, ROWS), r2,
                       None if hdh is None else jnp.exp2(g_last) * hdh)

        meet(done)

    outs = build(body, name="gdn_bwd_grads_ws", out_type=out_type_of(R, HV, K, V, dt, gated),
                 scratch=scratch, grid=(R // C, HV), grid_names=("c", "hv"), threads=2,
                 approx_math=bool(mosaic_bwd_grads.APPROX_MATH))(
        q, k, v, do, t0, hs, dh, vnT, dvnT, gcum, gsuf, beta)
    return tuple(outs) if gated else (*outs, None, None)
