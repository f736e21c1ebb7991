"""Chunked GLA (per-key decay g [B, T, H, K]) with Pallas Mosaic GPU kernels (Hopper, sm_90):
impl="mosaic".

Forward: XLA lays the rows out in chunks (gated_delta_rule/mosaic_layout.py); one chunk-parallel
Mosaic kernel (mosaic_intra_kernel.py) forms the chunk-local gate cumsum, the factors qg / kg
and the intra-chunk scores; one Mosaic kernel (mosaic_fwd_kernel.py) runs the state pass
fused with the output (with mosaic_split.SPLIT, the default, over sequence pieces when few CTAs).
Backward (jax.custom_vjp): by default (BACKWARD = "mosaic") the Mosaic backward of
mosaic_bwd.py, from the Mosaic forward's residuals; BACKWARD = "pallas": the Pallas
Triton-lowering kernels of pallas_chunk.py, which need the Pallas forward's residuals, so under
differentiation the Pallas forward runs instead of the Mosaic one. Both are GPU-proven (H100
parity, RESULTS.md runs 17 and 18): impl="auto" takes the Mosaic kernels on Hopper
(fla_contract.auto_kernel.AUTO_MOSAIC).

Takes q/k/v in bf16 or fp16 with K and V multiples of 64 up to 256;
`mosaic_unsupported_reason` says why a call is refused (fp32: use impl="pallas").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common.mosaic import check_mosaic, piece_scan
from ..gated_delta_rule import mosaic_pieces
from ..gated_delta_rule.mosaic_layout import from_rows, plan, to_rows
from . import mosaic_split
from .mosaic_bwd import Residuals
from .mosaic_bwd import backward as mosaic_backward
from .mosaic_fwd_kernel import gla_forward
from .mosaic_intra_kernel import gla_intra
from .pallas_chunk import chunk_gla_pallas

F32 = jnp.float32
OP = "chunk_gla"
# "mosaic" (the default): the Mosaic backward (mosaic_bwd.py; GPU-proven in run 18, faster:
# B4 T4096 H16 bf16 step 1.91 ms, 3.07 with "pallas"); "pallas": under differentiation the
# Pallas forward and backward run (GPU-proven, run 17)
BACKWARD = "mosaic"
BACKWARDS = ("mosaic", "pallas")
DTYPES = ("bfloat16", "float16")
MAX_HEAD = 256
# (K, V) a GPU parity run covered (RESULTS.md runs 17, 18: K = V = 128; run 19: gpu_k64_v256
# and gpu_k256_v64): impl="auto" takes the Mosaic kernels only there (fail closed);
# impl="mosaic" takes every multiple of 64 up to 256 (interpreted and lowered on CPU)
AUTO_HEADS = ((128, 128), (64, 256), (256, 64))


def auto_unsupported_reason(q, v) -> str | None:
    """Why impl='auto' keeps the Pallas kernels for a call the Mosaic kernels could take: head
    sizes no GPU parity run has covered yet (None: 'auto' may take them)."""
    heads = (q.shape[-1], v.shape[-1])
    if heads not in AUTO_HEADS:
        return (f"head sizes K={heads[0]}, V={heads[1]}: not yet GPU-proven for chunk_gla's "
                f"Mosaic kernels (proven: {AUTO_HEADS}); impl='mosaic' takes them")
    return None


def mosaic_unsupported_reason(q, k, v, g=None, initial_state=None, cu_seqlens=None,
                              **_) -> str | None:
    """Why the Mosaic kernels cannot take this call (None when they can). Shapes as for
    chunk_gla; checks dtypes and head sizes only (not the backend)."""
    name = jnp.dtype(q.dtype).name
    if name not in DTYPES:
        return (f"q/k/v dtype {name}: the Mosaic GPU kernels take bfloat16 or float16 "
                f"(16-bit wgmma operands); use impl='pallas' for {name}")
    for label, d in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if d % 64 or d > MAX_HEAD:
            return (f"head size {label}={d}: the Mosaic GPU kernels take multiples of 64 up "
                    f"to {MAX_HEAD}")
    return None


def forward(q, k, v, g, h0, cu_seqlens, *, scale: float, residuals: bool = False):
    """The Mosaic forward. q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K];
    h0: None or [N, H, K, V] fp32. Returns o [B, T, H, V] (q's dtype) and the final states
    [N, H, K, V] fp32; with `residuals` also what the Mosaic backward reads (mosaic_bwd.py):
    the row-layout inputs, the intra kernel's outputs and the state each chunk starts from."""
    B, T = q.shape[:2]
    lay, table = plan(B, T, cu_seqlens)
    qr, kr, vr = to_rows(q, lay), to_rows(k, lay), to_rows(v, lay)
    gr = to_rows(g.astype(F32), lay)
    qg, kg, a, last = gla_intra(qr, kr, gr)
    h0t = None if h0 is None else jnp.swapaxes(h0.astype(F32), -1, -2)
    N = table.shape[0]
    P = mosaic_split.pieces_for(lay, N, q.shape[2], v.shape[-1], cu_seqlens is not None)
    if P == 1:
        outs = gla_forward(qg, kg, vr, a, last, table, h0t, scale=scale, states=residuals)
    else:
        ptab = mosaic_pieces.piece_table(table, P)
        zero_tab = mosaic_pieces.piece_table(table, P, skip_last=True)
        (E,) = gla_forward(qg, kg, vr, a, last, zero_tab, None, scale=scale, outputs=False)
        D = mosaic_split.piece_factor(mosaic_split.piece_decay(last, ptab), N, P)
        starts, _ = piece_scan.diagonal_starts(E, D, h0t, N, P)
        outs = list(gla_forward(qg, kg, vr, a, last, ptab, starts, scale=scale,
                                states=residuals))
        outs[1] = mosaic_pieces.last_piece(outs[1], N, P)
    out = from_rows(outs[0], lay, B), jnp.swapaxes(outs[1], -1, -2)
    if not residuals:
        return out
    return out, Residuals(table, qr, kr, vr, gr, qg, kg, a, last, outs[2])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gla(q, k, v, g, h0, cu, scale):
    return forward(q, k, v, g, h0, cu, scale=scale)


def _gla_fwd(q, k, v, g, h0, cu, scale):
    if BACKWARD == "mosaic":   # the forward's intermediates and chunk states (mosaic_bwd.py)
        out, res = forward(q, k, v, g, h0, cu, scale=scale, residuals=True)
        return out, (res, h0, cu)

    def pallas(q, k, v, g, h0):
        return chunk_gla_pallas(q, k, v, g=g, scale=scale, initial_state=h0,
                                output_final_state=True, cu_seqlens=cu)
    out, vjp = jax.vjp(pallas, q, k, v, g, h0)   # the Pallas forward with its residuals
    return out, vjp


def _gla_bwd(scale, res, cts):
    if callable(res):      # the Pallas forward's vjp
        return (*res(cts), None)
    fwd_res, h0, cu = res
    return (*mosaic_backward(fwd_res, h0, cu, cts[0], cts[1], scale=scale), None)


_gla.defvjp(_gla_fwd, _gla_bwd)


def chunk_gla_mosaic(q, k, v, *, g, scale, initial_state=None, output_final_state=False,
                     cu_seqlens=None):
    """Chunked GLA as Mosaic GPU kernels (Hopper only; lowers anywhere via export_for_cuda).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; bf16 or fp16, one dtype; K, V multiples of 64 up
            to 256. g: [B, T, H, K] log-decay (<= 0), used in fp32. scale: float.
        initial_state: None or fp32 [N, H, K, V]. cu_seqlens: None or int [N+1] (B == 1), may
            be traced.
    Returns:
        o [B, T, H, V] in q's dtype; final state fp32 [N, H, K, V] or None unless
        output_final_state. Differentiable w.r.t. q, k, v, g, initial_state (the Mosaic
        backward, or with BACKWARD = "pallas" the Pallas one).
    Raises ValueError (named) off a Hopper GPU or for a call the kernels cannot take.
    """
    check_mosaic(OP, mosaic_unsupported_reason(q, k, v))
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    o, ht = _gla(q, k, v, g.astype(F32), initial_state, cu, float(scale))
    return o, (ht if output_final_state else None)
