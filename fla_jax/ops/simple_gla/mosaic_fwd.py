"""Forward Mosaic GPU (sm_90) kernel of chunked simple GLA: output and final state.

One CTA (one warpgroup) per (sequence n, head h, 64-column value block) walks the chunks of
C = 64 tokens in order, keeping the transposed state S^T [64, K] (fp32) in registers. With
g2 the chunk-local cumulative log-decay in log2 units ([C], fp32) and g_l its last entry:
    P   = (q k^T) * exp2(g2_i - g2_j) [j <= i]                 (fp32 accumulate, then dtype)
    o   = scale * (exp2(g2) * (q S) + P v)                      (q S from S^T in SMEM)
    S^T = exp2(g_l) S^T + v^T (k * exp2(g_l - g2))             (decayed k through SMEM)
TMA double-buffers the next chunk's q, k, v and gates while one chunk computes; o leaves
through a double-buffered SMEM tile and TMA stores.

Inputs are chunk-aligned: every sequence starts at a multiple of C and its rows past its end
are zero (common/mosaic/packing.py). The chunk range of a sequence is static (fixed-length
batch: sequence n = batch row n) or read from a table `seq` [N, SEQ_COLS] int32 (first chunk,
chunk count) in GMEM (varlen, and the pieces of mosaic_split.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.tiles import (COLS, F32, ROWS, build, causal_decay, load_vec, load_wgmma,
                                   matmul, products_during, rows_of, smem_tile, union,
                                   zeros_wgmma)

C = 64
BV = 64
SEQ_COLS = 32    # int32 columns of a row of the varlen table (one 128-byte TMA copy)
# Read when a kernel is traced. overlap: issue q k^T and q S together and form the decay
# masks while they run (else one product at a time). ws: the output pass on the
# warp-specialized kernel (mosaic_fwd_ws.py, K <= 128): H100 B4 T4096 H16 K=V=128 bf16 forward
# 0.117 ms vs 0.144 with this kernel in one process (RESULTS.md run 22).
TUNING = {"overlap": False, "ws": True}


def forward(q, k, v, g2, h0t, seq, *, scale: float, n_seqs: int, out_final: bool,
            mode: str = "output"):
    """q, k: [Bq, Tp, H, K]; v: [Bq, Tp, H, V] (one 16-bit dtype, Tp % 64 == 0);
    g2: [Bq, H, Tp] fp32 chunk-local cumsum of the log-decay times log2(e);
    h0t: None or [N, H, V, K] fp32 (transposed initial state); seq: None (fixed length,
    N == Bq, every sequence Tp long) or int32 [N, SEQ_COLS] (row n: first chunk, chunk count;
    Bq == 1).
    Returns o [Bq, Tp, H, V] in q's dtype and, with out_final, the transposed final state
    [N, H, V, K] fp32 (else None). mode="states" (the backward's recompute): no output;
    returns instead the transposed state entering every chunk, [Bq, H, Tp // 64, V, K] in q's
    dtype (chunks no sequence covers are not written), and the final state as above.
    mode="final": only the final state (None, final)."""
    if mode not in ("output", "states", "final") or (mode == "final" and not out_final):
        raise ValueError(f"mosaic forward: mode={mode!r}, out_final={out_final}")
    states = mode == "states"
    out_o = mode == "output"
    Bq, Tp, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype
    varlen = seq is not None
    has_h0 = h0t is not None
    static_chunks = Tp // C

    if states:
        out_type = [jax.ShapeDtypeStruct((Bq, H, Tp // C, V, K), dt)]
    elif out_o:
        out_type = [jax.ShapeDtypeStruct((Bq, Tp, H, V), dt)]
    else:
        out_type = []
    if out_final:
        out_type.append(jax.ShapeDtypeStruct((n_seqs, H, V, K), F32))
    # The fp32 state before the first and after the last chunk shares memory with q's
    # buffers (output mode) or the per-chunk state staging (states mode).
    work = smem_tile((2, C, K), dt) if out_o else smem_tile((2, BV, K), dt)
    scratch = dict(
        work_st=union(work, smem_tile((BV, K), F32)),
        k_s=smem_tile((2, C, K), dt),
        v_s=smem_tile((2, C, BV), dt), g_s=plgpu.SMEM((2, C), F32),
        s_s=smem_tile((BV, K), dt),
        in_bar=plgpu.Barrier(num_arrivals=4 if out_o else 3, num_barriers=2),
        one_bar=plgpu.Barrier(num_arrivals=1, num_barriers=1),
    )
    if out_o:
        scratch["o_s"] = smem_tile((2, C, BV), dt)
    if varlen:
        scratch["seq_s"] = plgpu.SMEM((SEQ_COLS,), jnp.int32)
        scratch["seq_bar"] = plgpu.Barrier(num_arrivals=1, num_barriers=1)

    def body(*refs, work_st, k_s, v_s, g_s, s_s, in_bar, one_bar, o_s=None, seq_s=None,
             seq_bar=None):
        work, st_s = work_st
        q_s, h_s = (work, None) if out_o else (None, work)
        refs = list(refs)
        q_ref, k_ref, v_ref, g_ref = (refs.pop(0) for _ in range(4))
        h0_ref = refs.pop(0) if has_h0 else None
        seq_ref = refs.pop(0) if varlen else None
        o_ref = refs.pop(0) if out_o or states else None
        ht_ref = refs.pop(0) if out_final else None
        n, h, iv = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("v")
        v0 = iv * BV
        if varlen:
            plgpu.copy_gmem_to_smem(seq_ref.at[n], seq_s, seq_bar.at[0])
            plgpu.barrier_wait(seq_bar.at[0])
            b, c0, nc = 0, seq_s[0], seq_s[1]
        else:
            b, c0, nc = n, 0, static_chunks

        def issue(c, slot):
            rows = pl.ds((c0 + c) * C, C)
            bar = in_bar.at[slot]
            if out_o:
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h, pl.ds(v0, BV)], v_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows], g_s.at[slot], bar)

        if has_h0:
            plgpu.copy_gmem_to_smem(h0_ref.at[n, h, pl.ds(v0, BV)], st_s, one_bar.at[0])
            plgpu.barrier_wait(one_bar.at[0])
            s0 = load_wgmma(st_s)
        else:
            s0 = zeros_wgmma((BV, K))

        @pl.when(nc > 0)
        def _first():
            plgpu.commit_smem()
            issue(0, 0)

        def output(c, slot, s_t, g_row):
            s_s[...] = s_t.astype(dt)
            plgpu.commit_smem()
            g_col = load_vec(g_s.at[slot], COLS)
            if TUNING["overlap"]:   # q k^T and q S in flight while the decays are formed
                (p, o), (d, q_decay) = products_during(
                    [(q_s.at[slot], k_s.at[slot], (C, C), False, True),
                     (q_s.at[slot], s_s, (C, BV), False, True)],
                    lambda: (causal_decay(g_row, g_col, (C, C)),
                             rows_of(jnp.exp2(g_row), (C, BV))))
                p = (p * d).astype(dt)
                o = o * q_decay
            else:
                p = matmul(q_s.at[slot], k_s.at[slot], (C, C), tb=True)
                p = (p * causal_decay(g_row, g_col, (C, C))).astype(dt)
                o = matmul(q_s.at[slot], s_s, (C, BV), tb=True)
                o = o * rows_of(jnp.exp2(g_row), (C, BV))
            o = matmul(p, v_s.at[slot], (C, BV), init=o)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            o_s.at[slot][...] = (o * scale).astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s.at[slot], o_ref.at[b, pl.ds((c0 + c) * C, C), h,
                                                            pl.ds(v0, BV)])

        def store_state(c, slot, s_t):
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            h_s.at[slot][...] = s_t.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(h_s.at[slot], o_ref.at[b, h, c0 + c, pl.ds(v0, BV)])

        def step(c, s_t):
            slot = lax.rem(c, 2)
            plgpu.barrier_wait(in_bar.at[slot])

            @pl.when(c + 1 < nc)
            def _prefetch():
                plgpu.commit_smem()
                issue(c + 1, 1 - slot)

            g_row = load_vec(g_s.at[slot], ROWS)
            if states:
                store_state(c, slot, s_t)
            elif out_o:
                output(c, slot, s_t, g_row)
            g_last = g_s[slot, C - 1]
            k_t = load_wgmma(k_s.at[slot]).astype(F32)
            s_s[...] = (k_t * rows_of(jnp.exp2(g_last - g_row), (C, K))).astype(dt)  # C == BV
            plgpu.commit_smem()
            return matmul(v_s.at[slot], s_s, (BV, K), init=s_t * jnp.exp2(g_last), ta=True)

        s_t = lax.fori_loop(0, nc, step, s0)
        if out_final:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            st_s[...] = s_t
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(st_s, ht_ref.at[n, h, pl.ds(v0, BV)])
        plgpu.wait_smem_to_gmem(0)

    args = [q, k, v, g2] + ([h0t] if has_h0 else []) + ([seq] if varlen else [])
    outs = build(body, name="simple_gla_mosaic_fwd", out_type=out_type, scratch=scratch,
                 grid=(n_seqs, H, V // BV), grid_names=("n", "h", "v"),
                 approx_math=True)(*args)
    outs = list(outs)
    first = outs.pop(0) if out_o or states else None
    return first, (outs.pop(0) if out_final else None)
