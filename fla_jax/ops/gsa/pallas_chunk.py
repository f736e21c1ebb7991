"""Chunked Gated Slot Attention as Pallas kernels on the chunk engine
(fla_jax/ops/common/engine): the mirror of fla_torch/ops/gsa/triton_chunk.py.

GSA is two gated passes with a softmax between them (gsa/interface.py). The value pass is GLA
(q = softmax(ok), k = s, v, per-key gate g, scale 1): the engine's stages as GLA runs them.
The slot pass has its gate on the value (slot) side; it is the adjoint of a GLA problem F with
keys s, values k and key gate g, whose states are hk^T [M, K]:
    ok = dQ of F for the cotangent do = q      (F's output gradient w.r.t. its queries)
so its forward is F's state pass plus the dq part of the engine's output backward
(output_stage.output_dq), and its backward is F run forward and backward with queries dok and
cotangent q:
    dq = o of F(Q = dok);  (ds, dk, dg, dhk0^T) = (dK, dV, dg, dh0) of F's backward.
No new kernel and no new gate switch: the engine's GATE_KEY stages with M as their key size.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common.engine import (GATE_KEY, make_problem, output_bwd, output_fwd, state_pass_bwd,
                             state_pass_fwd)
from ..common.engine import varlen as vl
from ..common.engine.launch import Launch, launch_for
from ..common.engine.output_stage import output_dq
from .slot_inputs import kernel_call

F32 = jnp.float32
# K x V block of GSA's state passes: GSA runs few heads, so the engine's 64 x 64 blocks leave
# B * H programs for the sequential walk over chunks; 32 x 32 blocks keep more SMs busy
# (H100, bf16 B=4 T=4096 H=4 K=V=M=64, fwd / fwd+bwd in one run: 0.764 / 2.920 ms with 32,
# 0.784 / 3.486 with 16, 1.374 / 3.496 with 64).
STATE_BLOCK = 32


def _state_launch(kernel, pb, dtype):
    """The engine's launch of state kernel `kernel` with its blocks capped at STATE_BLOCK."""
    lc = launch_for(kernel, pb.K, pb.V, dtype)
    return Launch(min(lc.bk or pb.Kp, STATE_BLOCK), min(lc.bv or pb.Vp, STATE_BLOCK),
                  lc.num_warps, lc.num_stages)


def _t(x):
    """[N, H, A, B] -> [N, H, B, A] (None stays None)."""
    return None if x is None else jnp.swapaxes(x, -1, -2)


def _seq(pb, cu):
    return vl.slot_sequences(cu, pb.T, pb.bt) if pb.varlen else None


def _forward(pbF, pbV, q, k, v, s, g, hk0, hv0, cu):
    seq = _seq(pbV, cu)
    hF, hkt_t = state_pass_fwd(pbF, s, k, g, _t(hk0), cu,
                               launch=_state_launch("state_fwd", pbF, q.dtype))
    ok = output_dq(pbF, s, s, k, g, hF, q, cu, seq)
    p32 = jax.nn.softmax(ok.astype(F32), axis=-1)
    p = p32.astype(q.dtype)
    hV, hvt = state_pass_fwd(pbV, s, v, g, hv0, cu,
                              launch=_state_launch("state_fwd", pbV, q.dtype))
    o = output_fwd(pbV, p, s, v, g, hV, cu, seq)
    return (o, _t(hkt_t), hvt), (hF, hV, p32, p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gsa_core(pbF, pbV, q, k, v, s, g, hk0, hv0, cu):
    """(o [B, T, H, V] in q's dtype, hk [N, H, K, M] fp32, hv [N, H, M, V] fp32); heads
    already expanded (HQ == H), g fp32."""
    return _forward(pbF, pbV, q, k, v, s, g, hk0, hv0, cu)[0]


def _fwd(pbF, pbV, q, k, v, s, g, hk0, hv0, cu):
    out, inner = _forward(pbF, pbV, q, k, v, s, g, hk0, hv0, cu)
    return out, (q, k, v, s, g, hk0, hv0, cu) + inner


def _bwd(pbF, pbV, res, cts):
    q, k, v, s, g, hk0, hv0, cu, hF, hV, p32, p = res
    do, dhkt, dhvt = cts
    seq = _seq(pbV, cu)
    do = do.astype(q.dtype)
    dhV, dhv0 = state_pass_bwd(pbV, p, do, g, dhvt.astype(F32), cu,
                               launch=_state_launch("state_bwd", pbV, q.dtype))
    dp, ds2, dv, dg2 = output_bwd(pbV, p, s, v, g, hV, do, dhV, cu, seq)
    dp = dp.astype(F32)
    dok = (p32 * (dp - jnp.sum(p32 * dp, axis=-1, keepdims=True))).astype(q.dtype)
    dq = output_fwd(pbF, dok, s, k, g, hF, cu, seq)
    dhF, dhk0t = state_pass_bwd(pbF, dok, q, g, _t(dhkt.astype(F32)), cu,
                                launch=_state_launch("state_bwd", pbF, q.dtype))
    _, ds1, dk, dg1 = output_bwd(pbF, dok, s, k, g, hF, q, dhF, cu, seq)
    ds = (ds1.astype(F32) + ds2.astype(F32)).astype(s.dtype)
    return dq, dk, dv, ds, dg1 + dg2, _t(dhk0t), dhv0, None


_gsa_core.defvjp(_fwd, _bwd)


def chunk_gsa_pallas(q, k, v, s, *, g=None, scale, initial_state=None,
                     output_final_state=False, cu_seqlens=None):
    """Pallas (Triton lowering) chunked GSA; runs interpreted off-GPU.

    Args:
        q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]; s: [B, T, H, M]; one dtype in
        bf16/fp16/fp32 (K, V, M <= 256). g: fp32 [B, T, H, M] log-decay or None (FLA's
        additive gate from s, formed in fp32, its weights rounded to q's dtype). scale: float.
        initial_state: None or (hk0 [N, H, K, M] | None, hv0 [N, H, M, V] | None) fp32.
        cu_seqlens: None or int [N+1] (B == 1), may be traced.
    Returns:
        o [B, T, HQ, V] in q's dtype; (hk [N, H, K, M], hv [N, H, M, V]) fp32 or None.
    """

    def run(q, k, v, s, g, scale, hk0, hv0, cu):
        pbF = make_problem(s, k, g, hk0, cu, scale, GATE_KEY)
        pbV = make_problem(s, v, g, hv0, cu, 1.0, GATE_KEY)
        return _gsa_core(pbF, pbV, q, k, v, s, g, hk0, hv0, cu)

    return kernel_call(run, q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)


__all__ = ["chunk_gsa_pallas"]
