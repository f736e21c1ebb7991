"""Mosaic GPU (sm_90) reverse state pass of the chunked gated delta rule backward: one CTA
(one warpgroup) per (sequence, value head, 64 value columns), chunks in reverse order.

With L^T [BV, K] fp32 in registers, the cotangent of the state leaving the current chunk
(dht at the sequence's end), and per chunk P = tril(q k^T) * exp2(G_i - G_j),
Gamma = exp2(G), w the WY key factor (given negated), the forward
    v_new = u - w S,   o = scale (Gamma q S + P v_new),   S' = exp2(G_last) S + (kd)^T v_new
(kd = k * exp2(G_last - G)) gives
    dv_new^T = scale do^T P + (L^T k^T) exp2(G_last - G)
    L^T      <- exp2(G_last) L^T + exp2(G_0) (scale (do^T Gamma') q - dv_new^T w')
with Gamma' = exp2(G - G_0) and w' = exp2(-G_0) w relative to the chunk's first row: the
common factor exp2(G_0) is applied to the fp32 product, never to a 16-bit operand (with
per-token gates near -20 it flushes fp16 operands to zero: dh0 lost every digit).
The kernel stores L^T of every chunk (before its update: the cotangent of the state the
chunk hands on) and dv_new^T, both in q's dtype (what the per-chunk gradient kernel,
mosaic_bwd_grads.py, reads as wgmma operands), and L^T after the first chunk (dh0, fp32).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.serial import (carried_state, issue_next_single_stage, sequence_range,
                                    wait_and_prefetch)
from ..common.mosaic.tiles import (COLS, F32, ROWS, WGMMA, build, causal_decay, cols_of,
                                  interpreting, load, matmul, matmuls, rows_of, smem_tile,
                                  zeros_wgmma)
from . import mosaic_fwd_kernel
from .mosaic_fwd_kernel import BV, C, SMEM_BUDGET, TABLE_WIDTH


def chain(init, *pairs, shape):
    """init + sum of op(a) @ b over pairs (a, b) or (a, b, ta) (op: transpose where ta; a
    16-bit SMEM ref then), one accumulator, one wait."""
    pairs = [(p + (False,))[:3] for p in pairs]
    if interpreting():
        out = init
        for a, b, ta in pairs:
            out = matmul(a, b, shape, init=out, ta=ta)
        return out

    def body(acc):
        for a, b, ta in pairs:
            plgpu.wgmma(acc, a.T if ta else a, b)
    return lax.optimization_barrier(pl.run_state(body)(plgpu.ACC.init(init)))


def _stages(K: int, dtype) -> int:
    isz = jnp.dtype(dtype).itemsize
    per_stage = 3 * C * K * isz + BV * C * isz + 3 * 4 * C
    fixed = C * C * isz + C * K * isz + BV * K * (4 + isz) + BV * C * isz + 1024
    return 2 if fixed + 2 * per_stage <= SMEM_BUDGET else 1


def reverse_states(q, k, wneg, do, gcum, gsuf, table, dhtT, *, scale: float, group: int):
    """q, k: [R, H, K]; wneg: [HV, R, K] (-w', w relative to each chunk's first row); do:
    [R, HV, V], all in one 16-bit dtype; gcum, gsuf: [HV, R] fp32 (G and G_last - G in log2
    units); table: [N, TABLE_WIDTH] int32 as in the forward; dhtT: None or [N, HV, V, K] fp32.
    Returns dh [R // C, HV, V, K] (L^T per chunk), dvnT [HV, V, R] (both in q's dtype) and
    dh0T [N, HV, V, K] fp32."""
    R, H, K = q.shape
    HV, V = do.shape[1], do.shape[2]
    N = table.shape[0]
    dtype = q.dtype
    has_dht = dhtT is not None
    stages = _stages(K, dtype)
    overlap = mosaic_fwd_kernel.OVERLAP and K <= 128
    vec = plgpu.SMEM((stages, C), F32)
    scratch = dict(
        q_s=smem_tile((stages, C, K), dtype),
        k_s=smem_tile((stages, C, K), dtype),
        w_s=smem_tile((stages, C, K), dtype),
        do_s=smem_tile((stages, C, BV), dtype),
        qg_s=smem_tile((C, K), dtype),
        g_c=vec, g_r=vec, s_c=vec,
        p_s=smem_tile((C, C), dtype),
        l_s=smem_tile((BV, K), F32),
        lo_s=smem_tile((BV, K), dtype),
        dv_s=smem_tile((BV, C), dtype),
        tab_s=plgpu.SMEM((TABLE_WIDTH,), jnp.int32),
        in_bar=plgpu.Barrier(num_arrivals=7, num_barriers=stages),
        one_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2),
    )
    out_type = [jax.ShapeDtypeStruct((R // C, HV, V, K), dtype),
                jax.ShapeDtypeStruct((HV, V, R), dtype),
                jax.ShapeDtypeStruct((N, HV, V, K), F32)]

    def body(*refs, q_s, k_s, w_s, do_s, qg_s, g_c, g_r, s_c, p_s, l_s, lo_s, dv_s, tab_s,
             in_bar, one_bar):
        refs = list(refs)
        q_ref, k_ref, w_ref, do_ref, gc_ref, gs_ref, tab_ref = refs[:7]
        dht_ref = refs[7] if has_dht else None
        dh_ref, dv_ref, dh0_ref = refs[-3:]
        n, hv, iv = lax.axis_index("n"), lax.axis_index("hv"), lax.axis_index("v")
        h = lax.div(hv, group)
        cols = pl.ds(iv * BV, BV)

        first, count = sequence_range(tab_ref, n, tab_s, one_bar.at[0])

        def issue(i, slot):   # i-th chunk from the end
            rows = pl.ds((first + count - 1 - i) * C, C)
            bar = in_bar.at[slot]
            plgpu.copy_gmem_to_smem(q_ref.at[rows, h], q_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(w_ref.at[hv, rows], w_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(do_ref.at[rows, hv, cols], do_s.at[slot], bar)
            for src, dst in ((gc_ref, g_c), (gc_ref, g_r), (gs_ref, s_c)):
                plgpu.copy_gmem_to_smem(src.at[hv, rows], dst.at[slot], bar)

        @pl.when(count > 0)
        def _():
            issue(0, 0)

        l0 = carried_state(dht_ref.at[n, hv, cols] if has_dht else None, l_s, one_bar.at[1],
                           (BV, K))

        sq, tile = (C, C), (BV, C)

        def step(i, l_t):
            # traced even for one stage: jax 0.11.2 fails to lower a constant slot here
            slot = lax.rem(i, stages)
            c = first + count - 1 - i
            wait_and_prefetch(i, count, slot, stages, in_bar, issue)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # lo_s, dv_s of the last chunk
            l_lo = l_t.astype(dtype)
            lo_s[...] = l_lo
            g_col = load(g_c.at[slot], COLS)
            g_row = load(g_r.at[slot], ROWS)
            decay = causal_decay(g_row, g_col, sq)
            if overlap:
                p, lk = matmuls((q_s.at[slot], k_s.at[slot], sq, None, False, True),
                                (l_lo, k_s.at[slot], tile, None, False, True))
            else:
                p = matmul(q_s.at[slot], k_s.at[slot], sq, tb=True)
                lk = matmul(l_lo, k_s.at[slot], tile, tb=True)             # L^T k^T
            p_s[...] = (p * decay * scale).astype(dtype)
            # scale Gamma' q (Gamma relative to the chunk's first row) for the state update
            g_first, g_last = g_c[slot, 0], g_c[slot, C - 1]
            qg = load(q_s.at[slot], WGMMA).astype(F32) * rows_of(
                jnp.exp2(g_row - g_first) * scale, (C, K))
            qg_s[...] = qg.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lo_s, dh_ref.at[c, hv, cols])
            kd = jnp.exp2(load(s_c.at[slot], COLS))
            dvn = matmul(do_s.at[slot], p_s, tile, init=lk * cols_of(kd, tile),
                         ta=True)                                            # dv_new^T
            dv_s[...] = dvn.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dv_s, dv_ref.at[hv, cols, pl.ds(c * C, C)])
            upd = chain(zeros_wgmma((BV, K)), (do_s.at[slot], qg_s, True),
                         (dvn.astype(dtype), w_s.at[slot]), shape=(BV, K))
            l_new = l_t * jnp.exp2(g_last) + upd * jnp.exp2(g_first)
            if stages == 1:
                issue_next_single_stage(i, count, issue)
            return l_new

        l_t = lax.fori_loop(0, count, step, l0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        l_s[...] = l_t
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(l_s, dh0_ref.at[n, hv, cols])
        plgpu.wait_smem_to_gmem(0)

    args = [q, k, wneg, do, gcum, gsuf, table] + ([dhtT] if has_dht else [])
    kernel = build(body, name="gdn_bwd_states", out_type=out_type, scratch=scratch,
                   grid=(N, HV, V // BV), grid_names=("n", "hv", "v"))
    return kernel(*args)
