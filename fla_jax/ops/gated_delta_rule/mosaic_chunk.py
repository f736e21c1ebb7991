"""Chunked gated delta rule (and the delta rule, g=None) with Pallas Mosaic GPU kernels
(Hopper, sm_90): impl="mosaic".

Forward: XLA prepares the chunk-aligned token layout (mosaic_layout.py) and one small kernel
the gate vectors and beta's rows (mosaic_gates.py); a chunk-parallel Mosaic kernel forms the
gate-free inverse T0 per chunk (mosaic_kkt.py); at K <= 128 (FORWARD="ws") the
warp-specialized kernel mosaic_fwd_ws.py then runs the sequential state pass fused with the output, applying the WY form in its chunk loop;
at K = 256 (or FORWARD="wy") the T0 kernel also forms the WY factors W' and U^T and the
one-warpgroup mosaic_fwd_kernel.py runs the state pass and the output. Few long sequences
(the serial passes at <= 32 CTAs, e.g. B=1 T=32768 H=16; fixed length or varlen) are cut into
sequence pieces run as separate sequences, from starts that the map pass mosaic_map_ws.py and
an XLA scan give (mosaic_pieces.py; the backward likewise): B1 T32768 GDN 0.680 / 2.207 ms vs
unsplit 1.109 / 3.094 (RESULTS.md run 21).
Backward (jax.custom_vjp; every gradient in its input's dtype), chosen by BACKWARD:
"mosaic" (default; K, V <= 128): under differentiation the forward also keeps its residuals
(chunk states, v_new and T0; the WY keys -W' too only for mosaic_bwd.REVERSE = "wy"), and
mosaic_bwd.py runs a Mosaic reverse state pass and a Mosaic per-chunk gradient kernel. H100
bf16 B4 T4096 H16 K=V=128: forward 0.232 ms, training step 0.885 ms for GDN (RESULTS.md run
20 call 10; jla 0.191 / 0.871 in the same call).
"pallas" (and K or V > 128, whose gradient tiles do not fit shared memory): the Pallas
Triton-lowering kernels of pallas_chunk.py; their backward needs the Pallas forward's
residuals, so under differentiation the Pallas forward runs instead of the Mosaic one
(training step 4.014 ms, run 14). Without differentiation (inference) the Mosaic forward runs.

Takes q/k/v in bf16 or fp16 with K and V in {64, 128, 256} (other multiples of 64 up to 256
too); `mosaic_unsupported_reason` says why a call is refused (fp32: use impl="pallas").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common.mosaic import check_mosaic
from . import mosaic_bwd, mosaic_fwd_ws, mosaic_pieces
from .mosaic_map_ws import piece_maps
from .mosaic_fwd_kernel import C, fused_forward
from .mosaic_gates import gate_inputs
from .mosaic_layout import from_rows, gate_free_inverse, l2norm, plan, to_rows
from .pallas_chunk import chunk_gated_delta_rule_pallas

F32 = jnp.float32
DTYPES = ("bfloat16", "float16")
BACKWARDS = ("pallas", "mosaic")
# The backward behind the Mosaic forward (see the module docstring): "mosaic" (K, V <= 128;
# else "pallas" is used) or "pallas"
BACKWARD = "mosaic"
# The forward: "ws" (T0 from mosaic_kkt.py, then the warp-specialized mosaic_fwd_ws.py applies
# the WY form inside its chunk loop; K <= 128) or "wy" (the T0 kernel also forms -W' and U^T;
# the one-warpgroup mosaic_fwd_kernel.py, which also serves K = 256)
FORWARD = "ws"
FORWARDS = ("ws", "wy")
# Training under FORWARD="ws" too: the T0 kernel forms T0 (and -W', the WY keys, for a reverse
# pass that reads them: mosaic_bwd.REVERSE = "wy") and the warp-specialized kernel also stores
# the chunk states and v_new (False: training takes the "wy" path)
TRAIN_WS = True
MAX_HEAD = 256


def mosaic_unsupported_reason(q, k, v, g=None, beta=None, initial_state=None,
                              cu_seqlens=None, **_) -> str | None:
    """Why the Mosaic kernels cannot take this call (None when they can). Shapes as for
    chunk_gated_delta_rule; checks dtypes and head sizes only (not the backend)."""
    name = jnp.dtype(q.dtype).name
    if name not in DTYPES:
        return (f"q/k/v dtype {name}: the Mosaic GPU kernels take bfloat16 or float16 "
                f"(16-bit wgmma operands); use impl='pallas' for {name}")
    K, V = q.shape[-1], v.shape[-1]
    for label, d in (("K", K), ("V", V)):
        if d % 64 or d > MAX_HEAD:
            return f"head size {label}={d}: the Mosaic GPU kernels take multiples of 64 up to {MAX_HEAD}"
    return None


OP = "chunk_gated_delta_rule"


def forward(q, k, v, g, beta, h0, cu_seqlens, *, scale: float, l2: bool,
            residuals: bool = False):
    """The Mosaic forward (lowers for CUDA on any machine: common/mosaic/lowering.py).
    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: None or [B, T, HV]; beta: [B, T, HV];
    h0: None or [N, HV, K, V] fp32. Returns o [B, T, HV, V] (q's dtype) and the final
    states [N, HV, K, V] fp32; with `residuals` also (hs, vnT, t0, wneg, maps): the forward
    kernel's chunk states and v_new, the gate-free inverse, the WY keys (None when the
    reverse pass reads T0: mosaic_bwd.reverse_from_t0) and the sequence split's piece maps
    (None without a split: mosaic_pieces.py), the residuals of mosaic_bwd.backward."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    if l2:
        q, k = l2norm(q), l2norm(k)
    lay, table = plan(B, T, cu_seqlens)
    qr, kr, vr = to_rows(q, lay), to_rows(k, lay), to_rows(v, lay)
    br = to_rows(beta.astype(F32), lay)                                  # [R, HV]
    gr = None if g is None else to_rows(g.astype(F32), lay)
    G, later, bt = gate_inputs(gr, br)                                   # [HV, R] each
    h0t = None if h0 is None else jnp.swapaxes(h0.astype(F32), -1, -2)
    group = HV // H
    if (FORWARD == "ws" and mosaic_fwd_ws.supports(K, q.dtype)
            and (TRAIN_WS or not residuals)):
        # T0 (and, for a backward whose reverse pass reads them, its WY keys -W'); the WY
        # form applied in the chunk loop
        with_w = residuals and not mosaic_bwd.reverse_from_t0()
        t0, *wneg = gate_free_inverse(kr, bt, group, q.dtype, gcum=G if with_w else None)
        wneg = wneg[0] if with_w else None
        N = table.shape[0]
        P = 1 if with_w else mosaic_pieces.pieces(N, HV, K, v.shape[-1],
                                                  qr.shape[0] // C // N, q.dtype)
        seqs, starts, split = table, h0t, None
        if P > 1:   # sequence pieces: their maps and starts; the pass runs over pieces
            mtab = mosaic_pieces.map_table(table, P, first_map=h0 is not None,
                                           last_map=residuals)
            maps = piece_maps(kr, vr, t0, G, later, bt, mtab)
            seqs = mosaic_pieces.piece_table(table, P)
            starts = mosaic_pieces.forward_starts(maps, h0t, N, P, K)
            # the backward's scan reads M^T of pieces 1 .. P-1
            split = maps[:, :, :K] if residuals else None
        # the delta rule (g None): the kernel without decays (G is zero: no gate vectors)
        ws_g = (None, None) if g is None else (G, later)
        outs = mosaic_fwd_ws.fused_forward_ws(qr, kr, vr, t0, *ws_g, bt, seqs, starts,
                                              scale=scale, residuals=residuals)
        if P > 1:
            outs = [outs[0], mosaic_pieces.last_piece(outs[1], N, P), *outs[2:]]
    else:
        # the WY factors (and, for the backward, T0) from one chunk-parallel kernel
        wy = gate_free_inverse(kr, bt, group, q.dtype, gcum=G, v_rows=vr, with_t0=residuals)
        t0, wneg, uT = wy if residuals else (None, *wy)
        outs = fused_forward(qr, kr, wneg, uT, G, later, table, h0t, scale=scale,
                             residuals=residuals)
        split = None
    o, ht = from_rows(outs[0], lay, B), jnp.swapaxes(outs[1], -1, -2)
    return (o, ht, (outs[2], outs[3], t0, wneg, split)) if residuals else (o, ht)


def _mosaic_backward(backward: str, K: int, V: int) -> bool:
    """The Mosaic backward runs (its gradient tiles fit SMEM for K, V <= 128), fed by the
    Mosaic forward's residuals; else the Pallas forward and backward."""
    return backward == "mosaic" and max(K, V) <= mosaic_bwd.MAX_HEAD


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _gdn(q, k, v, g, beta, h0, cu, scale, l2, backward):
    return forward(q, k, v, g, beta, h0, cu, scale=scale, l2=l2)


def _gdn_fwd(q, k, v, g, beta, h0, cu, scale, l2, backward):
    if _mosaic_backward(backward, q.shape[-1], v.shape[-1]):
        o, ht, extra = forward(q, k, v, g, beta, h0, cu, scale=scale, l2=l2, residuals=True)
        return (o, ht), (q, k, v, g, beta, h0, cu, extra)

    def pallas(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule_pallas(q, k, v, g=g, beta=beta, scale=scale,
                                             initial_state=h0, output_final_state=True,
                                             cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)

    # the Pallas forward with its residuals (see the module docstring); its vjp function is a
    # pytree of those residuals
    out, vjp = jax.vjp(pallas, q, k, v, g, beta, h0)
    return out, vjp


def _gdn_bwd(scale, l2, backward, res, cts):
    # which forward ran (_gdn_fwd): the cotangents carry K and V (dht [N, HV, K, V])
    if _mosaic_backward(backward, cts[1].shape[-2], cts[1].shape[-1]):
        q, k, v, g, beta, h0, cu, extra = res
        return (*mosaic_bwd.backward(q, k, v, g, beta, h0, cu, cts[0], cts[1], scale=scale,
                                     l2=l2, resid=extra), None)
    return (*res(cts), None)


_gdn.defvjp(_gdn_fwd, _gdn_bwd)


def chunk_gated_delta_rule_mosaic(q, k, v, *, g, beta, scale, initial_state,
                                  output_final_state, cu_seqlens,
                                  use_qk_l2norm_in_kernel=False, op=OP):
    """Chunked gated delta rule as Mosaic GPU kernels (Hopper only).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0); bf16 or fp16, one dtype.
        g: [B, T, HV] fp32 log-decay, or None (the delta rule); beta: [B, T, HV] fp32.
        scale: float. initial_state: None or [N, HV, K, V] fp32. cu_seqlens: None or int
        [N+1] (B == 1; may be traced). use_qk_l2norm_in_kernel: normalise q and k over K.
    Returns:
        o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] fp32, or None unless
        output_final_state. Differentiable w.r.t. q, k, v, g, beta, initial_state.
    """
    check_mosaic(op, mosaic_unsupported_reason(q, k, v))
    if BACKWARD not in BACKWARDS:
        raise ValueError(f"mosaic_chunk.BACKWARD: got {BACKWARD!r}, expected one of {BACKWARDS}")
    if FORWARD not in FORWARDS:
        raise ValueError(f"mosaic_chunk.FORWARD: got {FORWARD!r}, expected one of {FORWARDS}")
    mosaic_bwd.reverse_from_t0()      # REVERSE checked
    mosaic_pieces.check_scan()
    o, ht = _gdn(q, k, v, g, beta, initial_state, cu_seqlens, float(scale),
                 bool(use_qk_l2norm_in_kernel), BACKWARD)
    return o, (ht if output_final_state else None)
