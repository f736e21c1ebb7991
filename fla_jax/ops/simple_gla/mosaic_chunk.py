"""chunk_simple_gla with Pallas Mosaic GPU kernels (Hopper, sm_90): impl='mosaic'.

Forward: mosaic_fwd_ws.py (output and final state in one pass over the chunks, three
warpgroups; mosaic_fwd.py's one-warpgroup kernel where it does not take the head size). The
training forward also stores the state entering every chunk (RESIDUAL_STATES), which the
backward reads instead of recomputing it. Backward
(custom_vjp): mosaic_bwd.py when BACKWARD == "mosaic" and K, V <= 128, else the Pallas
Triton-lowering backward kernels of common/engine/scan.py (same math, same inputs).
Host side (mosaic_inputs.py): inputs laid out chunk-aligned (packing.py: T padded to a multiple
of 64, varlen sequences moved to chunk boundaries on device, no host sync), the log-decay's
chunk-local cumsum in log2 units, the state passed transposed ([N, H, V, K]).
Takes bf16/fp16 q/k/v with K and V multiples of 64 up to 256 (`mosaic_unsupported_reason`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..common.mosaic import check_mosaic, packing, piece_scan
from ..common.engine import scan
from . import mosaic_bwd, mosaic_fwd, mosaic_fwd_ws, mosaic_inputs, mosaic_split

OP = "chunk_simple_gla"
MAX_GRID = 65535
BACKWARDS = ("pallas", "mosaic")    # backward kernels available
# One of BACKWARDS, read when an op is traced. "mosaic" (K, V <= 128; larger heads take the
# Pallas backward): H100 training step 0.681 ms against the Pallas backward's 1.467 in the same
# process (RESULTS.md run 16 call 1; jla 0.748 in run 15 call 9), B4 T4096 H16 K=V=128 bf16;
# GPU parity (bf16 + fp16, every GPU case incl. gates of -10..-20 per token) 0 failed.
BACKWARD = "mosaic"
# The training forward stores the state entering every chunk ([B, H, T / 64, V, K] in q's
# dtype: twice q's bytes at K = V = 128) for the Mosaic backward, which otherwise recomputes
# it with a pass of its own (mosaic_fwd.forward mode="states"). False trades that pass for
# the memory. Read when an op is traced.
RESIDUAL_STATES = True


def mosaic_unsupported_reason(q, k, v, g=None, g_gamma=None, initial_state=None,
                              cu_seqlens=None) -> str | None:
    """Why the Mosaic kernels cannot take this call (None: they can). Arguments as in
    chunk_simple_gla."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return (f"q/k/v dtype {jnp.dtype(q.dtype).name}; the Mosaic kernels take bfloat16 or "
                f"float16 (impl='pallas' is fp32-accurate)")
    K, V = q.shape[-1], v.shape[-1]
    for name, size in (("K", K), ("V", V)):
        if size % 64 or not 64 <= size <= 256:
            return f"head size {name}={size}; the Mosaic kernels take multiples of 64 up to 256"
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if N > MAX_GRID or q.shape[2] > MAX_GRID:
        return f"{N} sequences x {q.shape[2]} heads; the Mosaic grid takes at most {MAX_GRID} each"
    return None


@dataclass(frozen=True)
class _Cfg:
    scale: float
    T: int
    N: int
    varlen: bool
    backward: str
    pieces: int      # sequence split of the serial passes (mosaic_split.py); 1: none


def _output_pass(q, k, v, g2, h0t, seq, scale, n_seqs, states):
    """(o, transposed final state, states entering each chunk or None) of mosaic_fwd.forward;
    the warp-specialized kernel where TUNING['ws'] selects it and it takes the head size (only
    it stores the states: None from the other)."""
    if mosaic_fwd.TUNING["ws"] and mosaic_fwd_ws.supports(q.shape[-1], q.dtype):
        outs = mosaic_fwd_ws.forward_ws(q, k, v, g2, h0t, seq, scale=scale, n_seqs=n_seqs,
                                        states=states)
        return outs if states else outs + (None,)
    o, ht = mosaic_fwd.forward(q, k, v, g2, h0t, seq, scale=scale, n_seqs=n_seqs,
                               out_final=True)
    return o, ht, None


def _forward(cfg, q, k, v, g, gamma, h0, cu, states=False):
    """(o, final state, hs): hs the transposed states entering each chunk in the kernels'
    layout (mosaic_bwd.backward's), when `states` and the output kernel stores them, else
    None."""
    lay = mosaic_inputs.layout(cfg.T, cu)
    a = packing.pack(mosaic_inputs.log_decay(q, g, gamma), lay)
    qp, kp, vp = (packing.pack(x, lay) for x in (q, k, v))
    h0t = None if h0 is None else jnp.swapaxes(h0, -1, -2)
    P = cfg.pieces
    if P == 1:
        g2 = mosaic_inputs.chunk_cumsum(a)
        o, ht, hs = _output_pass(qp, kp, vp, g2, h0t, lay.seq, cfg.scale, cfg.N, states)
    else:
        B, Tp = qp.shape[:2]
        flat = mosaic_inputs.flat
        qf, kf, vf = flat(qp), flat(kp), flat(vp)
        g2 = mosaic_inputs.chunk_cumsum(flat(a))
        seq = mosaic_split.table(B, Tp // mosaic_fwd.C, P)
        _, E = mosaic_fwd.forward(qf, kf, vf, g2, None, seq, scale=cfg.scale, n_seqs=B * P,
                                  out_final=True, mode="final")
        starts, ht = piece_scan.diagonal_starts(
            E, mosaic_split.piece_factor(mosaic_split.piece_decay(g2, B, P)), h0t, B, P)
        o, _, hs = _output_pass(qf, kf, vf, g2, starts, seq, cfg.scale, B * P, states)
        o = o.reshape(qp.shape[:3] + (v.shape[-1],))
    return packing.unpack(o, lay), jnp.swapaxes(ht, -1, -2), hs


def _mosaic_backward(cfg, K, V) -> bool:
    return cfg.backward == "mosaic" and mosaic_bwd.supports(K, V)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _simple_gla(cfg, q, k, v, g, gamma, h0, cu):
    return _forward(cfg, q, k, v, g, gamma, h0, cu)[:2]


def _vjp_fwd(cfg, q, k, v, g, gamma, h0, cu):
    states = RESIDUAL_STATES and _mosaic_backward(cfg, q.shape[-1], v.shape[-1])
    o, ht, hs = _forward(cfg, q, k, v, g, gamma, h0, cu, states=states)
    return (o, ht), (q, k, v, g, gamma, h0, cu, ht, hs)


def _vjp_bwd(cfg, res, cts):
    q, k, v, g, gamma, h0, cu, ht, hs = res
    do, dht = cts
    dht = dht.astype(jnp.float32)
    if _mosaic_backward(cfg, q.shape[-1], v.shape[-1]):
        dq, dk, dv, dg, dh0 = mosaic_bwd.backward(cfg, q, k, v, g, gamma, h0, cu, do, dht,
                                                  hs=hs)
    else:
        st = scan.make_static(q, v, g, gamma, h0, cu, cfg.scale)
        dq, dk, dv, dg, dh0 = scan.scan_bwd(scan.SCAN_KERNELS, st, q, k, v, g, gamma, h0, cu,
                                            ht, do, dht)
    dgamma = None if gamma is None else jnp.zeros_like(gamma)
    return dq, dk, dv, dg, dgamma, dh0, None


_simple_gla.defvjp(_vjp_fwd, _vjp_bwd)


def chunk_simple_gla_mosaic(q, k, v, *, g=None, g_gamma=None, scale, initial_state=None,
                            output_final_state=False, cu_seqlens=None):
    """Mosaic GPU chunked simple GLA (Hopper only; lowers anywhere via export_for_cuda).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in bf16/fp16; K, V multiples of 64 up
            to 256. g: None or fp32 [B, T, H] log-decay; g_gamma: None or fp32 [H].
        scale: float. initial_state: None or fp32 [N, H, K, V].
        cu_seqlens: None or int [N+1] (B == 1), may be traced.
    Returns:
        o [B, T, H, V] in q's dtype; final state fp32 [N, H, K, V] or None.
    Raises ValueError (named) off a Hopper GPU or for a call the kernels cannot take.
    Differentiable w.r.t. q, k, v, g, initial_state (g_gamma gets a zero cotangent).
    """
    check_mosaic(OP, mosaic_unsupported_reason(q, k, v, g, g_gamma, initial_state, cu_seqlens))
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    N = q.shape[0] if cu is None else cu.shape[0] - 1
    n_chunks = -(-q.shape[1] // mosaic_fwd.C)
    P = mosaic_split.pieces(q.shape[0], q.shape[2], v.shape[-1], n_chunks, cu is not None)
    cfg = _Cfg(float(scale), q.shape[1], N, cu is not None, BACKWARD, P)
    o, ht = _simple_gla(cfg, q, k, v, g, g_gamma, initial_state, cu)
    return o, (ht if output_final_state else None)
