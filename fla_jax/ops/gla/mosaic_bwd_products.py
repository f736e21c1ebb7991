"""Mosaic GPU (sm_90) kernel for the per-chunk products of the GLA backward (mosaic_bwd.py,
step 2), chunk-parallel: per chunk n of C rows and head h, from the row-layout do and v, the
forward's chunk states S_n^T and the reverse pass's dS_{n+1}^T (both [V, K], 16-bit) and the
chunk's log2 gate total `last`:
    dA    = scale do v^T                          [C, C + PAD] (columns C.. zero)
    dqg   = scale do S_n^T                        [C, K]
    dkg   = scale v dS_{n+1}^T                    [C, K]
    dstate = scale 2^last (sum_v S_n^T * dS_{n+1}^T)   [K]   (diag(S_n dS_{n+1}^T): the state
                                                  decay's gate term)
all fp32 (16-bit operands, fp32 accumulation on the tensor cores: exact products). It replaces
XLA's batched products on transposed copies of do and v and a separate reduce over both state
tensors (H100 profile, RESULTS.md run 18: 117 + 114 + 76 + 97 us, the copies 51+; the two
state tensors were read twice).

One CTA (one warpgroup) per (chunk, head): do and v loaded once, then the key columns in parts
of W (S_n^T, dS_{n+1}^T and last per part); the three products of a part issued together, one
wait. dA's staging buffer shares memory with the parts' (the dA store is waited for first), so
that two CTAs fit on an SM at K = V = 128.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.tiles import (F32, ROWS, build, iota, load, products_during, smem_tile,
                                   union, zeros_wgmma)
from .mosaic_intra_bwd_kernel import PAD
from .mosaic_intra_kernel import C

W = 64      # key columns per part


def gla_bwd_products(do_rows, v_rows, hs, dhs, last, *, scale: float):
    """do_rows, v_rows: [R, H, V] (one 16-bit dtype, chunks of C consecutive rows); hs, dhs:
    [R // C, H, V, K] in that dtype (S_n^T and dS_{n+1}^T per chunk); last: [H, R // C, K]
    fp32 (the chunk's log2 gate total). Returns dA [NC, H, C, C + PAD], dqg [NC, H, C, K],
    dkg [NC, H, C, K] and dstate [H, NC, K], all fp32 (see the module docstring)."""
    R, H, V = do_rows.shape
    NC = R // C
    K = hs.shape[-1]
    dt = do_rows.dtype
    if (R % C or K % W or V % W or v_rows.shape != (R, H, V) or v_rows.dtype != dt
            or hs.shape != (NC, H, V, K) or dhs.shape != (NC, H, V, K)
            or hs.dtype != dt or dhs.dtype != dt or last.shape != (H, NC, K)
            or last.dtype != F32):
        raise ValueError(
            f"gla_bwd_products: do_rows {do_rows.shape} {do_rows.dtype}, v_rows "
            f"{v_rows.shape} {v_rows.dtype}, hs {hs.shape} {hs.dtype}, dhs {dhs.shape} "
            f"{dhs.dtype}, last {last.shape} {last.dtype}; expected do/v [R, H, V] of one "
            f"16-bit dtype (R % {C} == 0, V % {W} == 0), hs/dhs [R // {C}, H, V, K] of that "
            f"dtype (K % {W} == 0), last [H, R // {C}, K] float32")
    scratch = dict(
        do_s=smem_tile((C, V), dt), v_s=smem_tile((C, V), dt),
        hs_s=smem_tile((V, W), dt), dhs_s=smem_tile((V, W), dt),
        last_s=plgpu.SMEM((W,), F32),
        # dA's staging (untiled: its padded pitch) then, once its store has read it, a part's
        outs=union(plgpu.SMEM((C, C + PAD), F32),
                   (smem_tile((C, W), F32), smem_tile((C, W), F32), plgpu.SMEM((W,), F32))),
        in_bar=plgpu.Barrier(num_arrivals=2), part_bar=plgpu.Barrier(num_arrivals=3),
    )
    out_type = (jax.ShapeDtypeStruct((NC, H, C, C + PAD), F32),
                jax.ShapeDtypeStruct((NC, H, C, K), F32),
                jax.ShapeDtypeStruct((NC, H, C, K), F32),
                jax.ShapeDtypeStruct((H, NC, K), F32))
    diag = (W, W)

    def body(do_ref, v_ref, hs_ref, dhs_ref, last_ref, da_ref, dqg_ref, dkg_ref, dst_ref,
             *, do_s, v_s, hs_s, dhs_s, last_s, outs, in_bar, part_bar):
        da_o, (dq_o, dk_o, dst_o) = outs
        n, h = lax.axis_index("n"), lax.axis_index("h")
        rows = pl.ds(n * C, C)

        def load_part(p):
            cols = pl.ds(p * W, W)
            plgpu.copy_gmem_to_smem(hs_ref.at[n, h, :, cols], hs_s, part_bar)
            plgpu.copy_gmem_to_smem(dhs_ref.at[n, h, :, cols], dhs_s, part_bar)
            plgpu.copy_gmem_to_smem(last_ref.at[h, n, cols], last_s, part_bar)

        plgpu.copy_gmem_to_smem(do_ref.at[rows, h], do_s, in_bar)
        plgpu.copy_gmem_to_smem(v_ref.at[rows, h], v_s, in_bar)
        load_part(0)                       # in flight during dA
        plgpu.barrier_wait(in_bar)
        (da,), _ = products_during(((do_s, v_s, (C, C), False, True),))
        da_o.at[:, pl.ds(0, C)][...] = da * scale
        da_o.at[:, pl.ds(C, PAD)][...] = zeros_wgmma((C, PAD))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(da_o, da_ref.at[n, h])
        on_diag = iota(diag, 0) == iota(diag, 1)
        for p in range(K // W):
            cols = pl.ds(p * W, W)
            plgpu.barrier_wait(part_bar)
            (dq, dk, ss), _ = products_during(((do_s, hs_s, (C, W), False, False),
                                               (v_s, dhs_s, (C, W), False, False),
                                               (hs_s, dhs_s, diag, True, False)))
            dsum = jnp.sum(jnp.where(on_diag, ss, 0.0), axis=1)
            gate = jnp.exp2(load(last_s, ROWS))
            if p + 1 < K // W:             # every thread is done with this part's inputs
                plgpu.commit_smem()
                load_part(p + 1)
            # the staging buffers' previous reads (dA's, then the last part's) are done
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            dq_o[...] = dq * scale
            dk_o[...] = dk * scale
            dst_o[...] = dsum * gate * scale
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_o, dqg_ref.at[n, h, :, cols])
            plgpu.copy_smem_to_gmem(dk_o, dkg_ref.at[n, h, :, cols])
            plgpu.copy_smem_to_gmem(dst_o, dst_ref.at[h, n, cols])
        plgpu.wait_smem_to_gmem(0)

    kernel = build(body, name="gla_bwd_products", out_type=out_type, scratch=scratch,
                   grid=(NC, H), grid_names=("n", "h"))
    return kernel(do_rows, v_rows, hs, dhs, last)
