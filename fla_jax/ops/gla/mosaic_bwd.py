"""The Mosaic GPU backward of chunked GLA (the default, mosaic_chunk.BACKWARD = "mosaic";
GPU-proven, RESULTS.md run 18). Per chunk n of C rows with b the chunk-local log2 gate
cumsum, qg = q 2^b, kg = k 2^(last - b), el = 2^last, from the Mosaic forward's residuals
(Residuals: the intra kernel's qg, kg, A, last and, from mosaic_fwd_kernel with `states`,
S_n^T, the state each chunk starts from):
1. the forward kernel in reverse chunk order on (qg' = kg, kg' = qg, A' = A^T, v' = do; the
   kernel transposes A's blocks as it reads them) with
   the carried state dS / scale: its output is dv = kg dS_{n+1} + scale A^T do, its stored
   states dS_{n+1} / scale, its final state dh0 / scale (dS_n = el dS_{n+1} + scale qg^T do);
2. dA = scale do v^T (the gradient kernel reads its lower triangle), dqg = scale do S_n^T,
   dkg = scale v dS_{n+1}^T and the state decay's gate term el (S_n . dS_{n+1}) per chunk and
   channel: one chunk-parallel Mosaic kernel (mosaic_bwd_products.py; PRODUCTS = "xla": XLA);
3. mosaic_intra_bwd_kernel: dq, dk and dg (dg_t = sum_{s >= t} r1_s + sum_{s < t} r2_s + that
   term, two scans within the chunk).
With mosaic_split.SPLIT the reverse pass runs over sequence pieces (mosaic_split.py).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..common.mosaic import piece_scan
from ..gated_delta_rule import mosaic_pieces
from ..gated_delta_rule.mosaic_layout import from_rows, plan, to_rows
from . import mosaic_split
from .mosaic_fwd_kernel import C, gla_forward
from .mosaic_bwd_products import gla_bwd_products
from .mosaic_intra_bwd_kernel import PAD, gla_intra_bwd

F32 = jnp.float32
# The per-chunk products dA, dqg, dkg and the gate term of step 2: "kernel" (the default: one
# chunk-parallel Mosaic kernel, mosaic_bwd_products.py, reading do, v and both state tensors
# once) or "xla" (batched products on transposed copies of do and v, a separate reduce)
PRODUCTS = "kernel"
PRODUCTS_CHOICES = ("kernel", "xla")


class Residuals(NamedTuple):
    """What mosaic_chunk.forward(residuals=True) keeps: the per-sequence table, the row-layout
    q, k, v [R, H, K|V] and g [R, H, K] fp32, the intra kernel's qg, kg [R, H, K], A [H, R, C]
    and last [H, R // C, K], and hs [R // C, H, V, K] (S_n^T, q's dtype)."""
    table: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    qg: jax.Array
    kg: jax.Array
    a: jax.Array
    last: jax.Array
    hs: jax.Array


def _dot32(spec, a, b):
    """einsum with fp32 accumulation of 16-bit operands (XLA on CPU has no bf16 x bf16 -> f32
    dot: the operands are widened there, exactly)."""
    if jax.default_backend() == "cpu":
        a, b = a.astype(F32), b.astype(F32)
    return jnp.einsum(spec, a, b, preferred_element_type=F32)


def _products_xla(dor, vr, hs, dhs, last, scale):
    """PRODUCTS = "xla": the per-chunk products (fp32 accumulation) on chunk-and-head-major
    operands (one transposed copy of do and of v; v's chunks padded by PAD zero rows, which
    gives dA its zero padding columns; dkg's padding rows dropped), outputs as the batched
    products leave them, and the state decay's gate term el (S_n . dS_{n+1})
    [H, NC, K]: what mosaic_bwd_products.gla_bwd_products forms in one kernel."""
    R, H, V = dor.shape
    NC = R // C
    dot = dor.reshape(NC, C, H, V).transpose(0, 2, 1, 3)
    vt = jnp.pad(vr.reshape(NC, C, H, V).transpose(0, 2, 1, 3),
                 ((0, 0), (0, 0), (0, PAD), (0, 0)))
    da = _dot32("nhiv,nhjv->nhij", dot, vt) * scale
    dqg = _dot32("nhcv,nhvk->nhck", dot, hs) * scale
    dkg = _dot32("nhcv,nhvk->nhck", vt, dhs)[:, :, :C] * scale
    dstate = jnp.einsum("nhvk,nhvk->hnk", hs.astype(F32), dhs.astype(F32)) * scale
    return da, dqg, dkg, dstate * jnp.exp2(last)


def backward(res: Residuals, h0, cu_seqlens, do, dht, *, scale: float):
    """Gradients of (o, final state) = chunk_gla(q, k, v, g, h0) for the cotangents do
    [B, T, H, V] and dht [N, H, K, V] fp32 (zeros when the final state is not used), from the
    forward's residuals. Returns dq, dk [B, T, H, K] (q's dtype), dv [B, T, H, V] (v's dtype),
    dg [B, T, H, K] fp32 and dh0 [N, H, K, V] fp32 (None without h0)."""
    B, T = do.shape[:2]
    lay, _ = plan(B, T, cu_seqlens)       # the forward's row layout (table: in res)
    table, qr, kr, vr, gr, qg, kg, a, last, hs = res
    H = qr.shape[1]
    V = vr.shape[-1]
    dor = to_rows(do.astype(qr.dtype), lay)
    dht_t = jnp.swapaxes(dht.astype(F32), -1, -2) / scale
    N = table.shape[0]
    P = mosaic_split.pieces_for(lay, N, H, V, cu_seqlens is not None)
    if P == 1:
        dv, dh0_t, dhs = gla_forward(kg, qg, dor, a, last, table, dht_t,
                                     scale=scale, reverse=True, states=True)
    else:   # the sequence split (mosaic_split.py): pieces from their end gradients
        ptab = mosaic_pieces.piece_table(table, P)
        (F,) = gla_forward(kg, qg, dor, a, last, mosaic_pieces.piece_table(
            table, P, skip_first=True), None, scale=scale, reverse=True, outputs=False)
        D = mosaic_split.piece_factor(mosaic_split.piece_decay(last, ptab), N, P)
        ends, _ = piece_scan.diagonal_ends(F, D, dht_t, N, P)
        dv, dh0_t, dhs = gla_forward(kg, qg, dor, a, last, ptab, ends, scale=scale,
                                     reverse=True, states=True)
        dh0_t = mosaic_pieces.first_piece(dh0_t, N, P)
    if PRODUCTS not in PRODUCTS_CHOICES:
        raise ValueError(f"mosaic_bwd.PRODUCTS={PRODUCTS!r}; expected one of {PRODUCTS_CHOICES}")
    if PRODUCTS == "kernel":
        da, dqg, dkg, dstate = gla_bwd_products(dor, vr, hs, dhs, last, scale=scale)
    else:
        da, dqg, dkg, dstate = _products_xla(dor, vr, hs, dhs, last, scale)
    dq, dk, dg = gla_intra_bwd(qr, kr, gr, da, dqg, dkg, dstate)
    dh0 = None if h0 is None else jnp.swapaxes(dh0_t, -1, -2) * scale
    return (from_rows(dq, lay, B), from_rows(dk, lay, B), from_rows(dv, lay, B).astype(vr.dtype),
            from_rows(dg, lay, B), dh0)
