"""chunk_simple_gla with Pallas Mosaic GPU kernels (Hopper, sm_90): impl='mosaic'.

Forward: mosaic_fwd.py (output and final state in one pass over the chunks). Backward
(custom_vjp): mosaic_bwd.py when BACKWARD == "mosaic", else the Pallas Triton-lowering
backward kernels of pallas_chunk.py (same math, same inputs).
Host side: the log-decay a = g + g_gamma (fp32) is laid out chunk-aligned (packing.py: T padded
to a multiple of 64, varlen sequences moved to chunk boundaries on device, no host sync), its
chunk-local cumsum taken in log2 units, and the state passed transposed ([N, H, V, K]).
Takes bf16/fp16 q/k/v with K and V multiples of 64 up to 256 (`mosaic_unsupported_reason`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..common.mosaic import check_mosaic, packing
from ..common.mosaic.tiles import LOG2E
from . import mosaic_fwd, pallas_chunk

OP = "chunk_simple_gla"
MAX_GRID = 65535
BACKWARDS = ("pallas",)    # backward kernels available
BACKWARD = "pallas"      # one of BACKWARDS: read when an op is traced


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


def _gate_cumsum(a, lay):
    """a [Bq, T, H] fp32 log-decay -> [Bq, H, Tp] chunk-local cumsum times log2(e)."""
    a = packing.pack(a, lay)
    Bq, Tp, H = a.shape
    c = mosaic_fwd.C
    a = jnp.cumsum(a.reshape(Bq, Tp // c, c, H), axis=2).reshape(Bq, Tp, H)
    return jnp.swapaxes(a * LOG2E, 1, 2)


def _forward(cfg, q, k, v, g, gamma, h0, cu):
    lay = packing.plan(cfg.T, cu, mosaic_fwd.C, mosaic_fwd.SEQ_COLS)
    a = jnp.zeros(q.shape[:3], jnp.float32) if g is None else g.astype(jnp.float32)
    if gamma is not None:
        a = a + gamma.astype(jnp.float32)[None, None, :]
    g2 = _gate_cumsum(a, lay)
    h0t = None if h0 is None else jnp.swapaxes(h0, -1, -2)
    o, ht = mosaic_fwd.forward(packing.pack(q, lay), packing.pack(k, lay), packing.pack(v, lay),
                               g2, h0t, lay.seq, scale=cfg.scale, n_seqs=cfg.N, out_final=True)
    return packing.unpack(o, lay), jnp.swapaxes(ht, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _simple_gla(cfg, q, k, v, g, gamma, h0, cu):
    return _forward(cfg, q, k, v, g, gamma, h0, cu)


def _vjp_fwd(cfg, q, k, v, g, gamma, h0, cu):
    o, ht = _forward(cfg, q, k, v, g, gamma, h0, cu)
    return (o, ht), (q, k, v, g, gamma, h0, cu, ht)


def _vjp_bwd(cfg, res, cts):
    q, k, v, g, gamma, h0, cu, ht = res
    do, dht = cts
    dht = dht.astype(jnp.float32)
    if cfg.backward == "mosaic":
        from . import mosaic_bwd
        dq, dk, dv, dg, dh0 = mosaic_bwd.backward(cfg, q, k, v, g, gamma, h0, cu, do, dht)
    else:
        st = pallas_chunk._make_static(q, v, g, gamma, h0, cu, cfg.scale)
        dq, dk, dv, dg, dh0 = pallas_chunk._backward(pallas_chunk._KERNELS, st, q, k, v, g,
                                                     gamma, h0, cu, ht, do, dht)
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
    cfg = _Cfg(float(scale), q.shape[1], N, cu is not None, BACKWARD)
    o, ht = _simple_gla(cfg, q, k, v, g, g_gamma, initial_state, cu)
    return o, (ht if output_final_state else None)
