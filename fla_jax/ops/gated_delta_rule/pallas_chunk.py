"""chunk_gated_delta_rule in Pallas (Triton lowering): the engine's scalar-gate delta rule
(common/engine/scalar_delta.py: WY / UT transform, the sequential state / output kernel, the
chunk-parallel backward; GATE_SCALAR with g, GATE_NONE for chunk_delta_rule) as one custom_vjp.
`backward="recurrent"` keeps the exact token-serial backward kernel of pallas_recurrent.py
(the forward then stores the fp32 u_t = v_t - k_t S'_t instead of the chunk residuals).
Grouped value heads: dq, dk come per value head and are summed here; use_qk_l2norm_in_kernel:
q, k are normalised inside the kernels, its backward applied here.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common.engine.scalar_delta import delta_backward, delta_forward
from ..common.pallas_delta_layout import (group_sum, l2norm_bwd, next_pow2, pad_last,
                                          sequence_bounds)
from .pallas_recurrent import _backward as recurrent_backward

F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _chunk(q, k, v, g, beta, h0, cu, scale, l2norm, want_ht, backward, fixed_len):
    o, ht, _ = delta_forward(q, k, v, g, beta, h0, cu, scale=scale, l2norm=l2norm, resid=None,
                             fixed_len=fixed_len)
    return o, ht


def _chunk_fwd(q, k, v, g, beta, h0, cu, scale, l2norm, want_ht, backward, fixed_len):
    resid = "u" if backward == "recurrent" else "h"
    o, ht, extra = delta_forward(q, k, v, g, beta, h0, cu, scale=scale, l2norm=l2norm,
                                 resid=resid, fixed_len=fixed_len)
    return (o, ht), (q, k, v, g, beta, h0, cu) + extra


def _chunk_bwd(scale, l2norm, want_ht, backward, fixed_len, res, cts):
    q, k, v, g, beta, h0, cu = res[:7]
    do, dht = cts
    H = q.shape[1]
    dht = dht.astype(F32) if want_ht else None
    if backward == "recurrent":
        (u,) = res[7:]
        dq, dk, dv, db, dg, dh0 = recurrent_backward(q, k, v, g, beta, h0, cu, u, do, dht,
                                                     scale=scale, l2norm=l2norm)
    else:
        w, uu, vn, hs, tm = res[7:]
        # dq, dk leave the kernel in q's dtype when nothing follows (no value groups to sum,
        # no l2norm backward): no fp32 round trip and cast (0.135 ms of the H100's GDN bwd)
        final = q.dtype if (v.shape[1] == H and not l2norm) else F32
        dq, dk, dv, db, dg, dh0 = delta_backward(q, k, v, g, beta, h0, cu, w, uu, vn, hs, tm,
                                                 do, dht, scale=scale, l2norm=l2norm,
                                                 fixed_len=fixed_len, dqk_dtype=final)
    dq, dk = group_sum(dq, H), group_sum(dk, H)
    if l2norm:
        dq, dk = l2norm_bwd(q, dq), l2norm_bwd(k, dk)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if g is None else dg.astype(g.dtype), db.astype(beta.dtype),
            None if h0 is None else dh0.astype(h0.dtype), None)


_chunk.defvjp(_chunk_fwd, _chunk_bwd)

BACKWARDS = ("chunk", "recurrent")


def chunk_gated_delta_rule_pallas(q, k, v, *, g, beta, scale, initial_state, output_final_state,
                                  cu_seqlens, use_qk_l2norm_in_kernel=False, backward="chunk"):
    """Chunked gated delta rule as Pallas kernels (Triton lowering; interpreted on CPU).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0); one dtype in {bf16, fp16, fp32}.
        g: [B, T, HV] fp32 raw log-decay (cumsum'd chunk-locally inside), or None (plain
        delta rule); beta: [B, T, HV] fp32. scale: float. initial_state: None or
        [N, HV, K, V] fp32. cu_seqlens: None or int [N+1] (B == 1; may be traced).
        use_qk_l2norm_in_kernel: normalise q and k over K in fp32 inside the kernels.
        backward: "chunk" (chunk-parallel kernels, the default) or "recurrent" (the exact
        token-serial backward kernel of pallas_recurrent.py, kept as a fallback).
    Returns:
        o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] fp32, or None unless
        output_final_state. Differentiable w.r.t. q, k, v, g, beta, initial_state.
    """
    if backward not in BACKWARDS:
        raise ValueError(f"backward: got {backward!r}, expected one of {BACKWARDS}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    Kp, Vp = max(16, next_pow2(K)), max(16, next_pow2(V))
    cu = sequence_bounds(B, T, cu_seqlens)
    qf = pad_last(q.reshape(B * T, H, K), Kp)
    kf = pad_last(k.reshape(B * T, H, K), Kp)
    vf = pad_last(v.reshape(B * T, HV, V), Vp)
    gf = None if g is None else g.reshape(B * T, HV)
    bf = beta.reshape(B * T, HV)
    h0 = initial_state
    if h0 is not None and (Kp != K or Vp != V):
        h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
    o, ht = _chunk(qf, kf, vf, gf, bf, h0, cu, float(scale), bool(use_qk_l2norm_in_kernel),
                   bool(output_final_state), backward, None if cu_seqlens is not None else T)
    o = o[..., :V].reshape(B, T, HV, V)
    if not output_final_state:
        return o, None
    return o, ht[:, :, :K, :V]
