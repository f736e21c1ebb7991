"""Mosaic GPU (sm_90) forward of the chunked gated delta rule: the sequential state pass
fused with the output, one CTA (one warpgroup) per (sequence, value head, 64 value columns).

Per chunk of C = 64 tokens (one sequence's rows of the chunk-aligned layout), with S^T
[BV, K] fp32 carried in registers, G the chunk-local cumsum of g (log2 units), Gamma = exp2(G)
and the WY factors from mosaic_kkt.py (chunk-parallel, off this kernel's sequential chain):
-W' (W = exp2(G_0) W' = Ag Gamma k) and U^T = (Ag v)^T, Ag the gated inverse times diag(beta):
    v_new^T = U^T - exp2(G_0) S^T W'^T                (= u - w S of the WY form)
    o       = scale ((Gamma q) S + P v_new),   P = tril(q k^T) * exp2(G_i - G_j)
    S^T     = exp2(G_last) S^T + (v_new^T exp2(G_last - G)) k
Two dependent products per chunk on the state chain (S^T W'^T, then the state update, issued
with the output's two). Every matmul runs on wgmma with an fp32 accumulator and 16-bit operands
(S^T and v_new go through shared memory in the input dtype, as FLA keeps h and v_new). The TMA
loads of chunk c + 1 are issued before chunk c is computed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.serial import (carried_state, issue_next_single_stage, sequence_range,
                                    store_final_state, store_output, wait_and_prefetch)
from ..common.mosaic.tiles import (COLS, F32, ROWS, WGMMA, build, causal_decay, cols_of, load,
                                  matmul, matmuls, rows_of, smem_tile, union)

OVERLAP = True   # issue a chunk's independent wgmmas together (2 waits per chunk, not 5); K <= 128

C = 64
BV = 64
TABLE_WIDTH = 32   # int32 entries per sequence row: a 128-byte TMA copy
SMEM_BUDGET = 200 * 1024


def _stages(K: int, dtype) -> int:
    """Input buffers in flight: 2 where they fit shared memory."""
    isz = jnp.dtype(dtype).itemsize
    per_stage = 3 * C * K * isz + BV * C * isz + 3 * 4 * C
    fixed = 2 * C * BV * isz + BV * C * isz + BV * K * isz + 1024   # o (2), v_new, S^T
    fixed += BV * K * 4 if K <= 128 else 0    # the fp32 state tile (K = 256: in the stages)
    return 2 if fixed + 2 * per_stage <= SMEM_BUDGET else 1


def fused_forward(q, k, wneg, uT, gcum, gsuf, table, h0t, *, scale: float,
                  residuals: bool = False):
    """q, k: [R, H, K] (16-bit, one dtype; R a multiple of 64, every sequence starting at a
    chunk boundary, padding rows zero); wneg: [HV, R, K] and uT: [HV, V, R] (q's dtype; -W' and
    U^T from mosaic_kkt.py); gcum, gsuf: [HV, R] fp32 (chunk-local cumsum G and G_last - G, both
    in log2 units); table: [N, TABLE_WIDTH] int32 (column 0: first chunk of sequence n, column
    1: its chunk count); h0t: None or [N, HV, V, K] fp32 (transposed initial states). Value head
    hv reads key head hv // (HV // H). Returns o [R, HV, V] in q's dtype and the transposed
    final states [N, HV, V, K] fp32; with `residuals` also the transposed state entering each
    chunk hs [R // C, HV, V, K] and v_new^T [HV, V, R], both in q's dtype."""
    R, H, K = q.shape
    HV, V = uT.shape[0], uT.shape[1]
    group = HV // H
    N = table.shape[0]
    dtype = q.dtype
    has_h0 = h0t is not None
    stages = _stages(K, dtype)
    overlap = OVERLAP and K <= 128
    vec = plgpu.SMEM((stages, C), F32)
    ins = (smem_tile((stages, C, K), dtype), smem_tile((stages, C, K), dtype),
           smem_tile((stages, C, K), dtype))                          # q, k, -W'
    st = smem_tile((BV, K), F32)
    # K = 256: the final (and initial) state's fp32 tile shares memory with the input stages
    # (it is read before the first load is issued and written after the last chunk's products)
    ins_st = union(ins, st) if K > 128 else (ins, st)
    scratch = dict(
        ins_st=ins_st,
        u_s=smem_tile((stages, BV, C), dtype),
        g_c=vec, g_r=vec, s_c=vec,
        s_s=smem_tile((BV, K), dtype),
        vn_s=smem_tile((BV, C), dtype),
        o_s=smem_tile((2, C, BV), dtype),
        tab_s=plgpu.SMEM((TABLE_WIDTH,), jnp.int32),
        in_bar=plgpu.Barrier(num_arrivals=7, num_barriers=stages),
        one_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2),
    )
    out_type = [jax.ShapeDtypeStruct((R, HV, V), dtype),
                jax.ShapeDtypeStruct((N, HV, V, K), F32)]
    if residuals:
        out_type += [jax.ShapeDtypeStruct((R // C, HV, V, K), dtype),
                     jax.ShapeDtypeStruct((HV, V, R), dtype)]

    def body(*refs, ins_st, u_s, g_c, g_r, s_c, s_s, vn_s, o_s, tab_s, in_bar, one_bar):
        (q_s, k_s, w_s), st_s = ins_st
        refs = list(refs)
        q_ref, k_ref, w_ref, u_ref, gc_ref, gs_ref, tab_ref = refs[:7]
        h0_ref = refs[7] if has_h0 else None
        o_ref, ht_ref = refs[-4:-2] if residuals else refs[-2:]
        hs_ref, vn_ref = refs[-2:] if residuals else (None, None)
        n, hv, iv = lax.axis_index("n"), lax.axis_index("hv"), lax.axis_index("v")
        h = lax.div(hv, group)
        cols = pl.ds(iv * BV, BV)

        first, count = sequence_range(tab_ref, n, tab_s, one_bar.at[0])

        def issue(i, slot):
            rows = pl.ds((first + i) * C, C)
            bar = in_bar.at[slot]
            plgpu.copy_gmem_to_smem(q_ref.at[rows, h], q_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(w_ref.at[hv, rows], w_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(u_ref.at[hv, cols, rows], u_s.at[slot], bar)
            for src, dst in ((gc_ref, g_c), (gc_ref, g_r), (gs_ref, s_c)):
                plgpu.copy_gmem_to_smem(src.at[hv, rows], dst.at[slot], bar)

        # before the first load: st_s may share the input stages' memory
        s0 = carried_state(h0_ref.at[n, hv, cols] if has_h0 else None, st_s, one_bar.at[1],
                           (BV, K))

        @pl.when(count > 0)
        def _():
            plgpu.commit_smem()
            issue(0, 0)

        sq, tile = (C, C), (BV, C)

        def step(i, s_t):
            # traced even for one stage: jax 0.11.2 fails to lower a constant slot here
            slot = lax.rem(i, stages)
            wait_and_prefetch(i, count, slot, stages, in_bar, issue)

            g_col = load(g_c.at[slot], COLS)
            g_row = load(g_r.at[slot], ROWS)
            s_lo = s_t.astype(dtype)
            g_first, g_last = g_c[slot, 0], g_c[slot, C - 1]
            if overlap:
                ks, p = matmuls((s_lo, w_s.at[slot], tile, None, False, True),
                                (q_s.at[slot], k_s.at[slot], sq, None, False, True))
            else:
                ks = matmul(s_lo, w_s.at[slot], tile, tb=True)            # -S^T W'^T
                p = matmul(q_s.at[slot], k_s.at[slot], sq, tb=True)
            if residuals:   # s_s and vn_s of the previous chunk have been stored
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            s_s[...] = s_lo
            vn = load(u_s.at[slot], WGMMA).astype(F32) + jnp.exp2(g_first) * ks   # v_new^T
            vn_s[...] = vn.astype(dtype)
            plgpu.commit_smem()
            if residuals:
                plgpu.copy_smem_to_gmem(s_s, hs_ref.at[first + i, hv, cols], commit_group=False)
                plgpu.copy_smem_to_gmem(vn_s, vn_ref.at[hv, cols, pl.ds((first + i) * C, C)],
                                        commit_group=False)
                plgpu.commit_smem_to_gmem_group()
            p_lo = (p * causal_decay(g_row, g_col, sq)).astype(dtype)
            vd_lo = (vn * cols_of(jnp.exp2(load(s_c.at[slot], COLS)), tile)).astype(dtype)
            s_decayed = s_t * jnp.exp2(g_last)
            if overlap:
                oq, pv, s_new = matmuls((q_s.at[slot], s_s, (C, BV), None, False, True),
                                        (p_lo, vn_s, (C, BV), None, False, True),
                                        (vd_lo, k_s.at[slot], (BV, K), s_decayed, False, False))
                o = (oq * rows_of(jnp.exp2(g_row), (C, BV)) + pv) * scale
            else:
                o = matmul(q_s.at[slot], s_s, (C, BV), tb=True) * rows_of(jnp.exp2(g_row),
                                                                          (C, BV))
                o = matmul(p_lo, vn_s, (C, BV), init=o, tb=True) * scale
                s_new = matmul(vd_lo, k_s.at[slot], (BV, K), init=s_decayed)
            store_output(o_s, i, o.astype(dtype),
                         o_ref.at[pl.ds((first + i) * C, C), hv, cols])
            if stages == 1:
                issue_next_single_stage(i, count, issue)
            return s_new

        s_t = lax.fori_loop(0, count, step, s0)
        store_final_state(st_s, s_t, ht_ref.at[n, hv, cols])

    args = [q, k, wneg, uT, gcum, gsuf, table] + ([h0t] if has_h0 else [])
    kernel = build(body, name="gdn_fwd", out_type=out_type, scratch=scratch,
                   grid=(N, HV, V // BV), grid_names=("n", "hv", "v"))
    return kernel(*args)
