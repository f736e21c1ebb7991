"""Mosaic GPU (sm_90) forward of chunked GLA (per-key decay): the sequential state pass fused
with the output, one CTA (one warpgroup) per (sequence, head, 64 value columns).

Per chunk of C = 64 tokens, with S^T [BV, K] fp32 carried in registers and the chunk-parallel
factors of mosaic_intra_kernel.py (qg = q exp2(b), kg = k exp2(last - b), the intra-chunk
scores A; b the chunk-local gate cumsum in log2 units, last its value on the chunk's last row):
    o   = scale (qg S + A v)
    S^T = S^T diag(exp2(last)) + v^T kg
The three products (qg S through S^T in SMEM, A v, the state update) are independent once S^T
is stored: one wait per chunk. 16-bit operands, fp32 accumulation; the TMA loads of chunk c + 1
are issued before chunk c is computed; o leaves through a double-buffered SMEM tile.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.serial import (carried_state, issue_next_single_stage, sequence_range,
                                    store_final_state, store_output, wait_and_prefetch)
from ..common.mosaic.tiles import COLS, F32, build, cols_of, load, matmuls, smem_tile, union
from ..gated_delta_rule.mosaic_fwd_kernel import BV, C, SMEM_BUDGET, TABLE_WIDTH


def _stages(K: int, dtype) -> int:
    """Input buffers in flight: 2 where they fit shared memory."""
    isz = jnp.dtype(dtype).itemsize
    per_stage = 2 * C * K * isz + C * BV * isz + C * C * isz + 4 * K
    fixed = 2 * C * BV * isz + BV * K * isz + 1024                  # o (2), S^T
    fixed += BV * K * 4 if K <= 128 else 0    # the fp32 state tile (K = 256: in the stages)
    return 2 if fixed + 2 * per_stage <= SMEM_BUDGET else 1


def gla_forward(qg, kg, v, a, last, table, h0t, *, scale: float, reverse: bool = False,
                states: bool = False, outputs: bool = True):
    """qg, kg: [R, H, K]; v: [R, H, V] (one 16-bit dtype; R a multiple of C, every sequence
    starting at a chunk boundary, padding rows zero); a: [H, R, C] (q's dtype, the intra-chunk
    scores, rows of chunk n at n*C .. n*C + C - 1); last: [H, R // C, K] fp32; table:
    [N, TABLE_WIDTH] int32 (first chunk, chunk count of sequence n); h0t: None or
    [N, H, V, K] fp32 (transposed initial states). Returns o [R, H, V] in q's dtype and the
    transposed final states [N, H, V, K] fp32; with `states` also the transposed state each
    chunk starts from, [R // C, H, V, K] in q's dtype. reverse: each sequence's chunks from the
    last to the first, each chunk's block of `a` transposed (A^T v: the backward's
    state-gradient pass, mosaic_bwd.py). outputs=False: the state pass alone (no qg, A or o
    product; o is not returned): (final states,) or (final states, states) — the sequence
    split's pass from zero (mosaic_chunk.py)."""
    R, H, K = qg.shape
    V = v.shape[2]
    N = table.shape[0]
    dtype = qg.dtype
    has_h0 = h0t is not None
    stages = _stages(K, dtype)
    overlap = K <= 128
    ins = (smem_tile((stages, C, K), dtype), smem_tile((stages, C, K), dtype))   # qg, kg
    st = smem_tile((BV, K), F32)
    scratch = dict(
        ins_st=union(ins, st) if K > 128 else (ins, st),
        v_s=smem_tile((stages, C, BV), dtype),
        a_s=smem_tile((stages, C, C), dtype),
        el_s=plgpu.SMEM((stages, K), F32),
        s_s=smem_tile((BV, K), dtype),
        o_s=smem_tile((2, C, BV), dtype),
        tab_s=plgpu.SMEM((TABLE_WIDTH,), jnp.int32),
        in_bar=plgpu.Barrier(num_arrivals=5, num_barriers=stages),
        one_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2),
    )
    out_type = ([jax.ShapeDtypeStruct((R, H, V), dtype)] if outputs else []) + [
        jax.ShapeDtypeStruct((N, H, V, K), F32)]
    if states:
        out_type.append(jax.ShapeDtypeStruct((R // C, H, V, K), dtype))

    def body(*refs, ins_st, v_s, a_s, el_s, s_s, o_s, tab_s, in_bar, one_bar):
        (q_s, k_s), st_s = ins_st
        q_ref, k_ref, v_ref, a_ref, el_ref, tab_ref = refs[:6]
        h0_ref = refs[6] if has_h0 else None
        o_ref, ht_ref = ((refs[6 + has_h0:8 + has_h0]) if outputs
                         else (None, refs[6 + has_h0]))
        hs_ref = refs[-1] if states else None
        n, h, iv = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("v")
        cols = pl.ds(iv * BV, BV)

        first, count = sequence_range(tab_ref, n, tab_s, one_bar.at[0])

        def chunk(i):
            """The chunk of step i (reverse: from the sequence's last chunk)."""
            return first + count - 1 - i if reverse else first + i

        def issue(i, slot):
            rows = pl.ds(chunk(i) * C, C)
            bar = in_bar.at[slot]
            plgpu.copy_gmem_to_smem(q_ref.at[rows, h], q_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(v_ref.at[rows, h, cols], v_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(a_ref.at[h, rows], a_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(el_ref.at[h, chunk(i)], el_s.at[slot], bar)

        # before the first load: st_s may share the input stages' memory
        s0 = carried_state(h0_ref.at[n, h, cols] if has_h0 else None, st_s, one_bar.at[1],
                           (BV, K))

        @pl.when(count > 0)
        def _():
            plgpu.commit_smem()
            issue(0, 0)

        def step(i, s_t):
            slot = lax.rem(i, stages)     # traced (jax 0.11.2: no constant slot in a loop)
            wait_and_prefetch(i, count, slot, stages, in_bar, issue)
            if states:   # the previous chunk's state store has read s_s (its o store may not)
                plgpu.wait_smem_to_gmem(1 if outputs else 0, wait_read_only=True)
            if outputs or states:
                s_s[...] = s_t.astype(dtype)
                plgpu.commit_smem()
            if states:
                plgpu.copy_smem_to_gmem(s_s, hs_ref.at[chunk(i), h, cols])
            s_decayed = s_t * cols_of(jnp.exp2(load(el_s.at[slot], COLS)), (BV, K))
            update = (v_s.at[slot], k_s.at[slot], (BV, K), s_decayed, True, False)
            if not outputs:      # the state pass alone
                (s_new,) = matmuls(update)
                if stages == 1:
                    issue_next_single_stage(i, count, issue)
                return s_new
            prods = ((q_s.at[slot], s_s, (C, BV), None, False, True),        # qg S
                     (a_s.at[slot], v_s.at[slot], (C, BV), None, reverse, False),  # A v
                     update)
            if overlap:
                oq, av, s_new = matmuls(*prods)
            else:
                oq, av, s_new = (matmuls(p)[0] for p in prods)
            o = (oq + av) * scale
            store_output(o_s, i, o.astype(dtype), o_ref.at[pl.ds(chunk(i) * C, C), h, cols])
            if stages == 1:
                issue_next_single_stage(i, count, issue)
            return s_new

        s_t = lax.fori_loop(0, count, step, s0)
        store_final_state(st_s, s_t, ht_ref.at[n, h, cols])

    args = [qg, kg, v, a, last, table] + ([h0t] if has_h0 else [])
    kernel = build(body, name="gla_fwd", out_type=out_type, scratch=scratch,
                   grid=(N, H, V // BV), grid_names=("n", "h", "v"))
    return kernel(*args)
