"""chunk_kda in Pallas (Triton lowering): the chunked delta rule with a per-key gate, forward
and backward as one jax.custom_vjp on the chunk engine (fla_jax/ops/common/engine); runs
interpreted off-GPU. The mirror of fla_torch/ops/kda/triton_chunk.py.

With b the in-chunk cumsum of g (per key channel), b_0 its first row and `last` its value at
the chunk's end, per chunk of 64 tokens and value head (h: the state before the chunk):
    Aqk_ij = sum_c q_ic k_jc exp(b_ic - b_jc) (j <= i),  Ak_ij likewise on (k, k) (j < i)
    T = (I + diag(beta) Ak)^-1,  w = T diag(beta) (k exp(b - b_0)),  u = T diag(beta) v
    vn = u - w diag(exp(b_0)) h,  h_next = diag(exp(last)) h + (k exp(last - b))^T vn
    o = scale ((q exp(b)) h + Aqk vn)
Stages: delta_scores (Aqk, Ak, kb, qg = q exp(b), and the state pass's kg = k exp(last - b),
exp(b_0), exp(last): chunk-parallel, out of the sequential pass), wy.wy_fwd (T, w, u),
delta_state.delta_state_fwd (h, vn, final state), output_stage.output_fwd (o on vn: the
engine's output stage on the given qg and Aqk: two dots, no gate work).
Backward: delta_prep.delta_prep_bwd (q exp(b - b_0), scale Aqk^T do, dAqk = scale do vn^T:
chunk-parallel),
delta_state.delta_state_bwd (dh, dvn, dh0), wy.wy_bwd (dv, dbeta, dkb, dAk: the gradients of
kb and of the key scores Ak), output_grads.output_bwd_from_scores on vn reading Aqk, with dAk
and dkb (dq, dk, dg: the output's Aqk / q exp(b) h / state-update terms and the key scores' and
kb's in the same intra / inter kernels, as Triton's delta_bwd; no dv / dA kernel).
Grouped heads: q and k are repeated to the HV value heads (their gradients summed back by
autodiff). use_qk_l2norm_in_kernel: q, k normalised in fp32 and rounded back to their dtype
first (jnp, differentiable).

`chunk_kda_pallas_dplr`: the former route (KDA as DPLR on engine/dplr.py), same signature,
kept for timing comparisons.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common import pallas_triton as ptr
from ..common.compute_operands import expand_heads, l2_normalize
from ..common.engine import GATE_KEY, output_fwd
from ..common.engine import varlen as vl
from ..common.engine.delta_prep import delta_prep_bwd
from ..common.engine.delta_scores import delta_scores
from ..common.engine.delta_state import delta_state_bwd, delta_state_fwd
from ..common.engine.dplr import dplr_chunk
from ..common.engine.launch import Problem
from ..common.engine.output_grads import output_bwd_from_scores
from ..common.engine.wy import wy_bwd, wy_fwd

F32 = jnp.float32
MAX_HEAD_DIM = 256


def _seq(pb, cu):
    return vl.slot_sequences(cu, pb.T, pb.bt) if pb.varlen else None


def _forward(pb, q, k, v, g, beta, h0, cu):
    seq = _seq(pb, cu)
    # fits: the diagonal-block decisions of delta_scores, kept for the backward's intra kernels
    Aqk, Ak, kb, qg, kg, e0, el, fits = delta_scores(pb, q, k, g, cu, seq, with_fits=True)
    Tm, w, u = wy_fwd(pb, Ak, kb, v, beta, cu, seq)
    h, vn, ht = delta_state_fwd(pb, kg, w, u, e0, el, h0, cu)
    o = output_fwd(pb, None, None, vn, None, h, cu, seq, A=Aqk, qg=qg)
    return o, ht, (Aqk, Ak, kb, Tm, w, h, vn, kg, e0, el, fits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(pb, q, k, v, g, beta, h0, cu):
    o, ht, _ = _forward(pb, q, k, v, g, beta, h0, cu)
    return o, ht


def _fwd(pb, q, k, v, g, beta, h0, cu):
    o, ht, res = _forward(pb, q, k, v, g, beta, h0, cu)
    return (o, ht), (q, k, v, g, beta, cu) + res


def _bwd(pb, res, cts):
    q, k, v, g, beta, cu, Aqk, Ak, kb, Tm, w, h, vn, kg, e0, el, fits = res
    do, dht = cts
    do = do.astype(q.dtype)
    seq = _seq(pb, cu)
    qd, ado, dA = delta_prep_bwd(pb, q, g, Aqk, do, vn, cu, seq)
    dh, dvn, dh0 = delta_state_bwd(pb, qd, kg, w, e0, el, ado, do, dht.astype(F32), cu)
    dv, dbeta, dkb, dAk = wy_bwd(pb, Ak, Tm, kb, v, beta, g, h, dvn, cu, seq)
    dq, dk, _, dg = output_bwd_from_scores(pb, q, k, vn, g, Aqk, h, do, dh, cu, seq,
                                           want_dv=False, dAk=dAk, dkb=dkb, dA=dA,
                                           fits=fits)
    return dq, dk, dv, dg, dbeta, dh0, None


_kda.defvjp(_fwd, _bwd)


def _check_sizes(q, v):
    for name, size in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if size > MAX_HEAD_DIM:
            raise ValueError(f"chunk_kda(impl='pallas'): head size {name}={size}; "
                             f"expected {name} <= {MAX_HEAD_DIM}")


def chunk_kda_pallas(q, k, v, *, g, beta, scale, initial_state, output_final_state,
                     cu_seqlens, use_qk_l2norm_in_kernel=False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0), one dtype in bf16/fp16/fp32
    (K, V <= 256); g: [B, T, HV, K] fp32; beta: [B, T, HV] fp32; initial_state: None or
    [N, HV, K, V] fp32; cu_seqlens: None or [N+1] int (B == 1, may be traced).
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None).
    Differentiable w.r.t. q, k, v, g, beta, initial_state."""
    _check_sizes(q, v)
    if use_qk_l2norm_in_kernel:
        q = l2_normalize(q.astype(F32)).astype(q.dtype)
        k = l2_normalize(k.astype(F32)).astype(k.dtype)
    B, T, _, K = q.shape
    HV = v.shape[2]
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens).astype(jnp.int32)
    N = B if cu is None else cu.shape[0] - 1
    pb = Problem(B=B, T=T, H=HV, K=K, V=v.shape[-1], N=N, scale=float(scale),
                 varlen=cu is not None, gate=GATE_KEY, has_h0=initial_state is not None,
                 precision=ptr.dot_precision(), bt=64, state_dtype=jnp.dtype(q.dtype).name)
    h0 = None if initial_state is None else initial_state.astype(F32)
    o, ht = _kda(pb, q, k, v, g.astype(F32), beta.astype(F32), h0, cu)
    return o, (ht if output_final_state else None)


def chunk_kda_pallas_dplr(q, k, v, *, g, beta, scale, initial_state, output_final_state,
                          cu_seqlens, use_qk_l2norm_in_kernel=False):
    """The DPLR route (engine/dplr.py: a = exp(g) k, b = -beta k, write key beta k, formed in
    fp32 with jnp); same arguments and returns as chunk_kda_pallas."""
    _check_sizes(q, v)
    qf, kf = q.astype(F32), k.astype(F32)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2_normalize(qf), l2_normalize(kf)
    HV = v.shape[2]
    qf, kf = expand_heads(qf, HV), expand_heads(kf, HV)
    g = g.astype(F32)
    bk = beta.astype(F32)[..., None] * kf
    o, ht = dplr_chunk(qf, bk, v, g, jnp.exp(g) * kf, -bk, float(scale), initial_state,
                       output_final_state, cu_seqlens)
    return o.astype(q.dtype), ht
