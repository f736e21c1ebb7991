"""Backward Mosaic GPU (sm_90) kernels of chunked simple GLA.

Per chunk (C = 64 tokens; g2 the chunk-local cumsum of the log-decay in log2 units, Γ_i =
exp2(g2_i), γ = exp2(g2_last), Γr_i = exp2(g2_last - g2_i), D_ij = exp2(g2_i - g2_j) [j <= i];
S the state entering the chunk, dS the gradient w.r.t. the state after it):

`dstate` (serial, reverse; one CTA per sequence, head and 64 value columns; dS^T [64, K] fp32 in
registers): stores dS of every chunk, then dS <- γ dS + scale (Γ q)^T do; returns the
gradient w.r.t. the initial state. Γ q is formed as q exp2(g2 - g2_0) (<= 1, no fp16
underflow) and the factor exp2(g2_0) applied to the fp32 product.

`grads` (one CTA per chunk and head; all of K and V):
    dq = scale (Γ (do S^T) + (P * D) k),          P = do v^T
    dk = Γr (v dS^T) + scale ((P * D)^T q)
    dv = Γr (k dS) + scale ((q k^T) * D)^T do
    per row (the gate terms, each scaling with the decay it differentiates):
    r1 = q . dq_inter + rowsum(M) - colsum(M)  (+ <γ S, dS> on the chunk's last row),
         dq_inter = scale Γ (do S^T),  M = scale (P * D) * (q k^T) below the diagonal,
    r2 = k . dk_state,  dk_state = Γr (v dS^T);
    dg_t = Σ_{s >= t} r1_s + Σ_{s < t} r2_s within the chunk (mosaic_inputs.chunk_gate_grad).
    colsum(M) is the row sum of M^T = scale (P * D)^T * (k q^T), formed from its own products.
    Not q . dq - k . dk: that sum cancels O(1) terms (the diagonal, Σ_j k_j . dk_state_j)
    and lost every digit of dg under gates of -10..-20 per token (H100, RESULTS.md run 15).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.tiles import (COLS, F32, ROWS, build, causal_decay, iota, iota_vec,
                                   load_vec, load_wgmma, matmul, rows_of, smem_tile, union)
from .mosaic_fwd import BV, C, SEQ_COLS


def dstate(q, do, g2, dhtt, seq, *, scale: float, n_seqs: int, want_dh0: bool):
    """q: [Bq, Tp, H, K]; do: [Bq, Tp, H, V] (16-bit); g2: [Bq, H, Tp] fp32; dhtt: [N, H, V, K]
    fp32 (transposed cotangent of the final state); seq as in mosaic_fwd.forward.
    Returns dS^T after every chunk [Bq, H, Tp // 64, V, K] in q's dtype (chunks no sequence
    covers are not written) and, with want_dh0, the transposed gradient w.r.t. the initial
    state [N, H, V, K] fp32 (else None)."""
    Bq, Tp, H, K = q.shape
    V = do.shape[-1]
    dt = q.dtype
    varlen = seq is not None
    static_chunks = Tp // C
    out_type = [jax.ShapeDtypeStruct((Bq, H, Tp // C, V, K), dt)]
    if want_dh0:
        out_type.append(jax.ShapeDtypeStruct((n_seqs, H, V, K), F32))
    scratch = dict(
        q_s=smem_tile((2, C, K), dt), do_s=smem_tile((2, C, BV), dt),
        g_s=plgpu.SMEM((2, C), F32), qd_s=smem_tile((C, K), dt),
        out_st=union(smem_tile((2, BV, K), dt), smem_tile((BV, K), F32)),
        in_bar=plgpu.Barrier(num_arrivals=3, num_barriers=2),
        one_bar=plgpu.Barrier(num_arrivals=1, num_barriers=1),
    )
    if varlen:
        scratch["seq_s"] = plgpu.SMEM((SEQ_COLS,), jnp.int32)
        scratch["seq_bar"] = plgpu.Barrier(num_arrivals=1, num_barriers=1)

    def body(*refs, q_s, do_s, g_s, qd_s, out_st, in_bar, one_bar, seq_s=None, seq_bar=None):
        out_s, st_s = out_st
        refs = list(refs)
        q_ref, do_ref, g_ref, dht_ref = (refs.pop(0) for _ in range(4))
        seq_ref = refs.pop(0) if varlen else None
        dh_ref = refs.pop(0)
        dh0_ref = refs.pop(0) if want_dh0 else None
        n, h, iv = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("v")
        v0 = iv * BV
        if varlen:
            plgpu.copy_gmem_to_smem(seq_ref.at[n], seq_s, seq_bar.at[0])
            plgpu.barrier_wait(seq_bar.at[0])
            b, c0, nc = 0, seq_s[0], seq_s[1]
        else:
            b, c0, nc = n, 0, static_chunks
        plgpu.copy_gmem_to_smem(dht_ref.at[n, h, pl.ds(v0, BV)], st_s, one_bar.at[0])
        plgpu.barrier_wait(one_bar.at[0])
        ds0 = load_wgmma(st_s)

        def issue(i, slot):      # i-th chunk from the end
            rows = pl.ds((c0 + nc - 1 - i) * C, C)
            bar = in_bar.at[slot]
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h, pl.ds(v0, BV)], do_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows], g_s.at[slot], bar)

        @pl.when(nc > 0)
        def _first():
            plgpu.commit_smem()
            issue(0, 0)

        def step(i, ds_t):
            slot = lax.rem(i, 2)
            c = nc - 1 - i
            plgpu.barrier_wait(in_bar.at[slot])

            @pl.when(i + 1 < nc)
            def _prefetch():
                plgpu.commit_smem()
                issue(i + 1, 1 - slot)

            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_s.at[slot][...] = ds_t.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s.at[slot], dh_ref.at[b, h, c0 + c, pl.ds(v0, BV)])
            g_row = load_vec(g_s.at[slot], ROWS)
            g_first = g_s[slot, 0]
            g_last = g_s[slot, C - 1]
            q_t = load_wgmma(q_s.at[slot]).astype(F32)
            qd_s[...] = (q_t * rows_of(jnp.exp2(g_row - g_first), (C, K))).astype(dt)
            plgpu.commit_smem()
            m = matmul(do_s.at[slot], qd_s, (BV, K), ta=True)
            return ds_t * jnp.exp2(g_last) + m * (scale * jnp.exp2(g_first))

        ds_t = lax.fori_loop(0, nc, step, ds0)
        if want_dh0:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            st_s[...] = ds_t
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(st_s, dh0_ref.at[n, h, pl.ds(v0, BV)])
        plgpu.wait_smem_to_gmem(0)

    args = [q, do, g2, dhtt] + ([seq] if varlen else [])
    outs = build(body, name="simple_gla_mosaic_bwd_dstate", out_type=out_type, scratch=scratch,
                 grid=(n_seqs, H, V // BV), grid_names=("n", "h", "v"),
                 approx_math=True)(*args)
    return outs[0], (outs[1] if want_dh0 else None)


def grads(q, k, v, do, g2, hs, dhs, *, scale: float):
    """q, k: [Bq, Tp, H, K]; v, do: [Bq, Tp, H, V] (16-bit); g2: [Bq, H, Tp] fp32;
    hs, dhs: [Bq, H, Tp // 64, V, K] (transposed state entering / state gradient after each
    chunk, q's dtype). Returns dq, dk [Bq, Tp, H, K], dv [Bq, Tp, H, V] in q's dtype and the
    gate terms r1, r2 [Bq, H, Tp] fp32 (module docstring)."""
    Bq, Tp, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype
    out_type = [jax.ShapeDtypeStruct(q.shape, dt), jax.ShapeDtypeStruct(k.shape, dt),
                jax.ShapeDtypeStruct(v.shape, dt), jax.ShapeDtypeStruct((Bq, H, Tp), F32),
                jax.ShapeDtypeStruct((Bq, H, Tp), F32)]
    scratch = dict(
        q_s=smem_tile((C, K), dt), k_s=smem_tile((C, K), dt),
        v_s=smem_tile((C, V), dt), do_s=smem_tile((C, V), dt),
        h_s=smem_tile((V, K), dt), dh_s=smem_tile((V, K), dt),
        # the gates twice: one buffer per register layout they are read in (one buffer read
        # as rows and as columns fails Mosaic layout inference on jax 0.11.2)
        g_s=plgpu.SMEM((C,), F32), gc_s=plgpu.SMEM((C,), F32), r_s=plgpu.SMEM((C,), F32),
        r2_s=plgpu.SMEM((C,), F32),
        dq_s=smem_tile((C, K), dt), dk_s=smem_tile((C, K), dt), dv_s=smem_tile((C, V), dt),
        bar=plgpu.Barrier(num_arrivals=8, num_barriers=1),
    )

    def body(q_ref, k_ref, v_ref, do_ref, g_ref, h_ref, dh_ref, dq_ref, dk_ref, dv_ref, r_ref,
             r2_ref, q_s, k_s, v_s, do_s, h_s, dh_s, g_s, gc_s, r_s, r2_s, dq_s, dk_s, dv_s,
             bar):
        b, h, c = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("c")
        rows = pl.ds(c * C, C)
        for src, dst in ((q_ref.at[b, rows, h], q_s), (k_ref.at[b, rows, h], k_s),
                         (v_ref.at[b, rows, h], v_s), (do_ref.at[b, rows, h], do_s),
                         (g_ref.at[b, h, rows], g_s), (g_ref.at[b, h, rows], gc_s),
                         (h_ref.at[b, h, c], h_s),
                         (dh_ref.at[b, h, c], dh_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        g_row = load_vec(g_s, ROWS)
        g_col = load_vec(gc_s, COLS)
        g_last = g_s[C - 1]
        decay = jnp.exp2(g_row)
        rdecay = jnp.exp2(g_last - g_row)
        # dq = scale (Γ (do S^T) + (P * D) k)
        p = matmul(do_s, v_s, (C, C), tb=True) * causal_decay(g_row, g_col, (C, C))
        dq = matmul(do_s, h_s, (C, K)) * rows_of(decay * scale, (C, K))   # dq_inter
        ri, ci = iota((C, C), 0), iota((C, C), 1)
        m = jnp.where(ri > ci, p * matmul(q_s, k_s, (C, C), tb=True) * scale, 0.0)
        r = jnp.sum(load_wgmma(q_s).astype(F32) * dq, axis=1) + jnp.sum(m, axis=1)
        dq = matmul((p * scale).astype(dt), k_s, (C, K), init=dq)
        dq_s[...] = dq.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dq_s, dq_ref.at[b, rows, h])
        # dk = Γr (v dS^T) + scale (P * D)^T q
        dec_t = causal_decay(g_row, g_col, (C, C), transposed=True)
        pt = matmul(v_s, do_s, (C, C), tb=True) * dec_t
        kq = matmul(k_s, q_s, (C, C), tb=True)
        r = r - jnp.sum(jnp.where(ci > ri, pt * kq * scale, 0.0), axis=1)     # colsum(M)
        dk_inter = matmul(v_s, dh_s, (C, K)) * rows_of(rdecay, (C, K))
        r2_s[...] = jnp.sum(load_wgmma(k_s).astype(F32) * dk_inter, axis=1)
        dk = matmul((pt * scale).astype(dt), q_s, (C, K), init=dk_inter)
        dk_s[...] = dk.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dk_s, dk_ref.at[b, rows, h])
        # dv = Γr (k dS) + scale ((q k^T) * D)^T do
        at = kq * dec_t
        dv = matmul(k_s, dh_s, (C, V), tb=True) * rows_of(rdecay, (C, V))
        dv = matmul((at * scale).astype(dt), do_s, (C, V), init=dv)
        dv_s[...] = dv.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dv_s, dv_ref.at[b, rows, h])
        # <γ S, dS> on the last row
        state = jnp.exp2(g_last) * jnp.sum(jnp.sum(
            load_wgmma(h_s).astype(F32) * load_wgmma(dh_s).astype(F32), axis=1))
        r_s[...] = r + jnp.where(iota_vec(C, ROWS) == C - 1, state, 0.0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(r_s, r_ref.at[b, h, rows])
        plgpu.copy_smem_to_gmem(r2_s, r2_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    return build(body, name="simple_gla_mosaic_bwd_grads", out_type=out_type, scratch=scratch,
                 grid=(Bq, H, Tp // C), grid_names=("b", "h", "c"),
                 approx_math=True)(q, k, v, do, g2, hs, dhs)
