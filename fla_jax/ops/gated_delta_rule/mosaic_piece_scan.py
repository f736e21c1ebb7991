"""The delta family's scan over sequence pieces (mosaic_pieces.py) as one small Mosaic GPU
(sm_90) kernel: fp32 products on the tensor cores, nothing for XLA to autotune.

Forward (the state entering every piece, transposed, S^T [V, K] per value head):
    out_0 = S^T_0 (h0^T or 0),  out_{p+1} = out_p M_p^T + E_p^T     p = 0 .. P - 2
Backward (the gradient leaving every piece):
    out_{P-1} = dS^T (dht^T or 0),  out_{p-1} = out_p M_p + F_p^T   p = P - 1 .. 1
with M_p^T the rows :K of the piece's map ([K, K] fp32, mosaic_map_ws.py) and E_p^T / F_p^T
[V, K] fp32 rows of another array. A zero start takes no product (the map of that piece is
not walked: mosaic_pieces.map_table).

fp32 products from bf16 tensor-core products: each fp32 operand is split into three bf16
parts (x = hi + mid + lo, exact to ~2^-24 relative) and the six products of parts with
weight >= 2^-16 are summed in one fp32 accumulator (the scheme of XLA's BF16_BF16_F32_X6
dot algorithm): fp32-level accuracy, where one bf16 product would round to 2^-9.

One warpgroup per (sequence, value head, 64 state rows); per piece it loads the map's rows
[K, K] and the 64 rows of E / F (TMA), splits the map into three bf16 SMEM tiles in two
64-row blocks, and stores the state of the next piece through the fp32 staging tile.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.tiles import (F32, WGMMA, build, interpreting, load, matmul_sum,
                                   smem_tile, zeros_wgmma)
from .mosaic_fwd_kernel import BV

BF16 = jnp.bfloat16
KS = (64, 128)      # head sizes whose [K, K] fp32 map and bf16 parts fit in SMEM (192 KB at 128)


def supports(K: int, V: int) -> bool:
    return K in KS and V % BV == 0


def _parts(x):
    """fp32 -> three bf16 parts, hi + mid + lo == x to ~2^-24 relative."""
    hi = x.astype(BF16)
    r = x - hi.astype(F32)
    mid = r.astype(BF16)
    lo = (r - mid.astype(F32)).astype(BF16)
    return hi, mid, lo


def _product(a_parts, b_refs, shape, transposed: bool):
    """sum of the six products a_i b_j (i + j <= 2) in fp32: a_parts bf16 registers [BV, K],
    b_refs bf16 SMEM tiles [K, K] (transposed: b_j^T)."""
    order = ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0))     # smallest first
    if interpreting():     # transposed refs do not interpret
        out = jnp.zeros(shape, F32)
        for i, j in order:
            b = b_refs[j][...]
            out = out + jnp.dot(a_parts[i].astype(F32), (b.T if transposed else b).astype(F32),
                                precision=lax.Precision.HIGHEST)
        return out
    return matmul_sum(tuple((a_parts[i], b_refs[j].T if transposed else b_refs[j])
                            for i, j in order), shape)


def piece_scan(m, x, s0, *, N: int, P: int, K: int, x_row: int, backward: bool):
    """m [N * P, HV, >= K, K] fp32 (rows :K of each piece: M^T); x [N * P, HV, x_row + V, K]
    fp32 (rows x_row .. x_row + V: E^T, or F^T backward); s0 None (zeros) or [N, HV, V, K]
    fp32 (h0^T; dht^T backward) -> [N * P, HV, V, K] fp32 (forward: the state entering each
    piece; backward: the gradient leaving each piece), transposed states."""
    HV, V = x.shape[1], x.shape[2] - x_row
    if m.dtype != F32 or x.dtype != F32 or (s0 is not None and s0.dtype != F32):
        raise TypeError(f"piece_scan: m, x, s0 must be float32; got {m.dtype}, {x.dtype}, "
                        f"{None if s0 is None else s0.dtype}")
    if not supports(K, V) or m.shape[0] != N * P or x.shape[0] != N * P:
        raise ValueError(f"piece_scan: K={K} (expected one of {KS}), V={V} (a multiple of "
                         f"{BV}), {N * P} pieces; m {m.shape}, x {x.shape}")
    has_s0 = s0 is not None
    scratch = dict(
        m_s=smem_tile((K, K), F32), x_s=smem_tile((BV, K), F32),
        parts=tuple(smem_tile((K, K), BF16) for _ in range(3)),
        bars=plgpu.Barrier(num_arrivals=1, num_barriers=3),    # map, x rows, s0
    )

    def body(*refs, m_s, x_s, parts, bars):
        refs = list(refs)
        m_ref, x_ref = refs.pop(0), refs.pop(0)
        s0_ref = refs.pop(0) if has_s0 else None
        out_ref, = refs
        n, hv, iv = lax.axis_index("n"), lax.axis_index("hv"), lax.axis_index("v")
        rows = pl.ds(iv * BV, BV)
        xrows = pl.ds(x_row + iv * BV, BV)

        def store(p, s):
            """s -> out[piece p] through x_s (whose last store's read is waited for)."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            x_s[...] = s
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_s, out_ref.at[n * P + p, hv, rows])

        def step(p, s, with_product: bool):
            """The state of the next piece from piece p's map and rows."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # x_s's store has read it
            if with_product:
                plgpu.copy_gmem_to_smem(m_ref.at[n * P + p, hv, pl.ds(0, K)], m_s, bars.at[0])
            plgpu.copy_gmem_to_smem(x_ref.at[n * P + p, hv, xrows], x_s, bars.at[1])
            if not with_product:
                plgpu.barrier_wait(bars.at[1])
                return load(x_s, WGMMA)
            a_parts = _parts(s)
            plgpu.barrier_wait(bars.at[0])
            for r0 in range(0, K, 64):    # the map's bf16 parts, 64 rows at a time
                for ref, part in zip(parts, _parts(load(m_s.at[pl.ds(r0, 64)], WGMMA))):
                    ref.at[pl.ds(r0, 64)][...] = part
            plgpu.commit_smem()
            out = _product(a_parts, parts, (BV, K), transposed=backward)
            plgpu.barrier_wait(bars.at[1])
            return out + load(x_s, WGMMA)

        if has_s0:
            plgpu.copy_gmem_to_smem(s0_ref.at[n, hv, rows], x_s, bars.at[2])
            plgpu.barrier_wait(bars.at[2])
            s = load(x_s, WGMMA)
        else:
            s = zeros_wgmma((BV, K))
        first, last, inc = (P - 1, 0, -1) if backward else (0, P - 1, 1)
        store(first, s)
        if not has_s0:     # a zero start: the first piece's map is not read (nor walked)
            s = step(first, s, with_product=False)
            store(first + inc, s)
            first += inc
        if first != last:
            def loop(i, s):
                p = first + inc * i
                s = step(p, s, with_product=True)
                store(p + inc, s)
                return s
            lax.fori_loop(0, (last - first) * inc, loop, s)
        plgpu.wait_smem_to_gmem(0)

    kernel = build(body, name="gdn_piece_scan_bwd" if backward else "gdn_piece_scan",
                   out_type=jax.ShapeDtypeStruct((N * P, HV, V, K), F32), scratch=scratch,
                   grid=(N, HV, V // BV), grid_names=("n", "hv", "v"))
    return kernel(m, x, *([s0] if has_s0 else []))
