"""Token-by-token GLA (per-key-channel log-decay) as Pallas kernels (Triton lowering),
forward and backward.

Per sequence and head, a_t = exp(g_t) in R^K:
    S_t = diag(a_t) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t             S: [K, V] fp32
Each key row of S is a scalar-gated recurrence of its own, so the kernels are the scalar-gate
ones (fla_jax/ops/simple_gla/pallas_recurrent.py) with the decay a row scaling and every
gate-gradient term kept per channel. Programs = one sequence, one head, one block of K or V:
    forward  (n, h, V-block) tokens forward:  o_t, final state
    dq       (n, h, K-block) tokens forward:  dq_t = scale S_t do_t; p_t = q_t * (scale a_t
                                               S_{t-1} do_t) per channel; fin = rowsum(dS_T *
                                               a_T S_{T-1})
    dv       (n, h, V-block) tokens backward: dS += scale q_t^T do_t; dv_t = dS^T k_t;
                                               dS = diag(a_t) dS
    dk       (n, h, K-block) tokens backward: dk_t = dS v_t, dh0, per channel
                                               dg_t = fin + sum_{s >= t} (p_s - x_s),
                                               x_s = k_s * (a_{s+1} dS_{s+1} v_s), x_T = 0
dg is thereby written without the terms that cancel: the current token's
scale q_s k_s (v_s . do_s) of q * dq and k * dk, and k_T (dS_T v_T), part of rowsum(dS_T S_T).
Shapes: q, k [B, T, H, K]; v [B, T, H, V] (one dtype); g [B, T, H, K] fp32; states
[N, H, K, V] fp32; cu_seqlens None or int32 [N+1] (B == 1, may be traced).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..common import pallas_triton as ptr
from ..common.engine import GATE_KEY, Launch, Problem
from ..common.engine import specs
from ..common.engine import varlen as vl
from ..common.engine.launch import call

STATE_ELEMS = 4096      # register state of one program: K-block x V-block elements
F32 = jnp.float32


def _launches(pb, dtype):
    """(forward V-block, backward K-block, backward V-block) launches."""
    stages = 1
    fwd = Launch(None, min(pb.Vp, max(16, STATE_ELEMS // pb.Kp)), 4, stages)
    bk = Launch(min(pb.Kp, max(16, 2 * STATE_ELEMS // pb.Vp)), None, 4, stages)
    bv = Launch(None, min(pb.Vp, max(16, 2 * STATE_ELEMS // pb.Kp)), 4, stages)
    return fwd, bk, bv


def _row(refs, name, t, n_cols, col0=0):
    return ptr.load_row(refs[name], t, n_cols, col0).astype(F32)


def _bounds(refs, pb):
    return vl.sequence_bounds(refs, pb.varlen, pb.T, pl.program_id(0))


def _fwd_kernel(refs, pb, bv):
    c0 = pl.program_id(2) * bv
    bos, L = _bounds(refs, pb)
    S0 = (ptr.load_tile(refs["h0"], pb.K, pb.V, 0, c0) if pb.has_h0
          else jnp.zeros((pb.Kp, bv), F32))

    def body(i, S):
        t = bos + i
        q, k = _row(refs, "q", t, pb.K), _row(refs, "k", t, pb.K)
        v = _row(refs, "v", t, pb.V, c0)
        a = jnp.exp(_row(refs, "g", t, pb.K))
        S = S * a[:, None] + k[:, None] * v[None, :]
        ptr.store_row(refs["o"], t, pb.scale * jnp.sum(q[:, None] * S, 0), pb.V, c0)
        return S

    S = lax.fori_loop(0, L, body, S0)
    ptr.store_tile(refs["ht"], S, pb.K, pb.V, 0, c0)


def _dq_kernel(refs, pb, bk):
    r0 = pl.program_id(2) * bk
    bos, L = _bounds(refs, pb)
    S0 = (ptr.load_tile(refs["h0"], pb.K, pb.V, r0, 0) if pb.has_h0
          else jnp.zeros((bk, pb.Vp), F32))
    zk, zv = jnp.zeros((bk,), F32), jnp.zeros((pb.Vp,), F32)

    def body(i, carry):
        # carried: P = a_{t-1} S_{t-2} and the previous token's k, v (its k^T v is added here),
        # so that after the loop P = a_T S_{T-1}
        P, k_prev, v_prev = carry
        t = bos + i
        k, q = _row(refs, "k", t, pb.K, r0), _row(refs, "q", t, pb.K, r0)
        v, do = _row(refs, "v", t, pb.V), _row(refs, "do", t, pb.V)
        a = jnp.exp(_row(refs, "g", t, pb.K, r0))
        P = (P + k_prev[:, None] * v_prev[None, :]) * a[:, None]
        dq_in = pb.scale * jnp.sum(P * do[None, :], 1)
        ptr.store_row(refs["dq"], t, dq_in + k * (pb.scale * jnp.sum(v * do)), pb.K, r0)
        ptr.store_row(refs["qdq"], t, q * dq_in, pb.K, r0)
        return P, k, v

    P, _, _ = lax.fori_loop(0, L, body, (S0, zk, zv))
    dht = ptr.load_tile(refs["dht"], pb.K, pb.V, r0, 0)
    cols = r0 + jnp.arange(bk)
    plt.store(refs["fin"], jnp.sum(dht * P, 1), mask=cols < pb.K)


def _dv_kernel(refs, pb, bv):
    c0 = pl.program_id(2) * bv
    bos, L = _bounds(refs, pb)
    dS0 = ptr.load_tile(refs["dht"], pb.K, pb.V, 0, c0)

    def body(i, dS):
        t = bos + L - 1 - i
        q, k = _row(refs, "q", t, pb.K), _row(refs, "k", t, pb.K)
        do = _row(refs, "do", t, pb.V, c0)
        dS = dS + pb.scale * q[:, None] * do[None, :]
        ptr.store_row(refs["dv"], t, jnp.sum(dS * k[:, None], 0), pb.V, c0)
        return dS * jnp.exp(_row(refs, "g", t, pb.K))[:, None]

    lax.fori_loop(0, L, body, dS0)


def _dk_kernel(refs, pb, bk):
    r0 = pl.program_id(2) * bk
    bos, L = _bounds(refs, pb)
    dS0 = ptr.load_tile(refs["dht"], pb.K, pb.V, r0, 0)
    cols = r0 + jnp.arange(bk)
    carry0 = plt.load(refs["fin"], mask=cols < pb.K, other=0.0)

    def body(i, state):
        dS, carry = state
        t = bos + L - 1 - i
        q, k = _row(refs, "q", t, pb.K, r0), _row(refs, "k", t, pb.K, r0)
        v, do = _row(refs, "v", t, pb.V), _row(refs, "do", t, pb.V)
        # dk_t = (a_{t+1} dS_{t+1}) v_t + scale q_t (do_t . v_t): the carried part first
        dk_in = jnp.sum(dS * v[None, :], 1)
        dS = dS + pb.scale * q[:, None] * do[None, :]
        ptr.store_row(refs["dk"], t, dk_in + q * (pb.scale * jnp.sum(do * v)), pb.K, r0)
        # k * dk without the current-token term; at the last token the carried part
        # k_T (dS_T v_T) is left out too (the carry starts from fin instead)
        kdk = jnp.where(i > 0, k * dk_in, 0.0)
        carry = carry + _row(refs, "qdq", t, pb.K, r0) - kdk
        ptr.store_row(refs["dg"], t, carry, pb.K, r0)
        return dS * jnp.exp(_row(refs, "g", t, pb.K, r0))[:, None], carry

    dS, _ = lax.fori_loop(0, L, body, (dS0, carry0))
    if pb.has_h0:
        ptr.store_tile(refs["dh0"], dS, pb.K, pb.V, r0, 0)


def _cu_input(pb, cu):
    return [("cu", cu, specs.full(cu))] if pb.varlen else []


def _fin_spec(bk):
    return pl.BlockSpec((None, None, bk), lambda n, h, j: (n, h, j))


def _forward(pb, q, k, v, g, h0, cu):
    fwd, _, _ = _launches(pb, q.dtype)
    bv = fwd.bv
    ins = [("q", q, specs.seq_rows(pb, pb.Kp, specs.zero)),
           ("k", k, specs.seq_rows(pb, pb.Kp, specs.zero)),
           ("v", v, specs.seq_rows(pb, bv, specs.same)),
           ("g", g, specs.seq_rows(pb, pb.Kp, specs.zero))] + _cu_input(pb, cu)
    if pb.has_h0:
        ins.append(("h0", h0, specs.state(pb.Kp, bv, specs.zero, specs.same)))
    outs = [("o", jax.ShapeDtypeStruct(v.shape, q.dtype), specs.seq_rows(pb, bv, specs.same)),
            ("ht", jax.ShapeDtypeStruct((pb.N, pb.H, pb.K, pb.V), F32),
             specs.state(pb.Kp, bv, specs.zero, specs.same))]
    r = call(lambda refs: _fwd_kernel(refs, pb, bv), (pb.N, pb.H, pl.cdiv(pb.V, bv)), ins, outs,
             fwd, "gla_recurrent_fwd")
    return r["o"], r["ht"]


def _backward(pb, q, k, v, g, h0, cu, do, dht):
    _, lk, lv = _launches(pb, q.dtype)
    bk, bv = lk.bk, lv.bv
    NK, NV = pl.cdiv(pb.K, bk), pl.cdiv(pb.V, bv)
    row_tile = specs.state(bk, pb.Vp, specs.same, specs.zero)
    kblock = [("q", q, specs.seq_rows(pb, bk, specs.same)),
              ("k", k, specs.seq_rows(pb, bk, specs.same)),
              ("v", v, specs.seq_rows(pb, pb.Vp, specs.zero)),
              ("do", do, specs.seq_rows(pb, pb.Vp, specs.zero)),
              ("g", g, specs.seq_rows(pb, bk, specs.same))] + _cu_input(pb, cu)

    ins = kblock + [("dht", dht, row_tile)]
    if pb.has_h0:
        ins.append(("h0", h0, row_tile))
    fin = jax.ShapeDtypeStruct((pb.N, pb.H, pb.K), F32)
    outs = [("dq", jax.ShapeDtypeStruct(q.shape, q.dtype), specs.seq_rows(pb, bk, specs.same)),
            ("qdq", jax.ShapeDtypeStruct(g.shape, F32), specs.seq_rows(pb, bk, specs.same)),
            ("fin", fin, _fin_spec(bk))]
    r = call(lambda refs: _dq_kernel(refs, pb, bk), (pb.N, pb.H, NK), ins, outs, lk,
             "gla_recurrent_bwd_dq")

    ins = [("q", q, specs.seq_rows(pb, pb.Kp, specs.zero)),
           ("k", k, specs.seq_rows(pb, pb.Kp, specs.zero)),
           ("do", do, specs.seq_rows(pb, bv, specs.same)),
           ("g", g, specs.seq_rows(pb, pb.Kp, specs.zero))] + _cu_input(pb, cu)
    ins.append(("dht", dht, specs.state(pb.Kp, bv, specs.zero, specs.same)))
    outs = [("dv", jax.ShapeDtypeStruct(v.shape, v.dtype), specs.seq_rows(pb, bv, specs.same))]
    dv = call(lambda refs: _dv_kernel(refs, pb, bv), (pb.N, pb.H, NV), ins, outs, lv,
              "gla_recurrent_bwd_dv")["dv"]

    ins = kblock + [("qdq", r["qdq"], specs.seq_rows(pb, bk, specs.same)),
                    ("fin", r["fin"], _fin_spec(bk)), ("dht", dht, row_tile)]
    outs = [("dk", jax.ShapeDtypeStruct(k.shape, k.dtype), specs.seq_rows(pb, bk, specs.same)),
            ("dg", jax.ShapeDtypeStruct(g.shape, F32), specs.seq_rows(pb, bk, specs.same))]
    if pb.has_h0:
        outs.append(("dh0", jax.ShapeDtypeStruct(h0.shape, F32), row_tile))
    rk = call(lambda refs: _dk_kernel(refs, pb, bk), (pb.N, pb.H, NK), ins, outs, lk,
              "gla_recurrent_bwd_dk")
    return r["dq"], rk["dk"], dv, rk["dg"], rk.get("dh0")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _recurrent(pb, q, k, v, g, h0, cu):
    return _forward(pb, q, k, v, g, h0, cu)


def _recurrent_fwd(pb, q, k, v, g, h0, cu):
    return _forward(pb, q, k, v, g, h0, cu), (q, k, v, g, h0, cu)


def _recurrent_bwd(pb, res, cts):
    q, k, v, g, h0, cu = res
    do, dht = cts
    dq, dk, dv, dg, dh0 = _backward(pb, q, k, v, g, h0, cu, do.astype(q.dtype),
                                    dht.astype(F32))
    return dq, dk, dv, dg, dh0, None


_recurrent.defvjp(_recurrent_fwd, _recurrent_bwd)


def fused_recurrent_gla_pallas(q, k, v, *, g, scale, initial_state=None,
                               output_final_state=False, cu_seqlens=None):
    """Pallas (Triton lowering) token-by-token GLA; runs interpreted off-GPU.

    Args and returns as `pallas_chunk.chunk_gla_pallas`: q, k [B, T, H, K], v [B, T, H, V]
    (bf16/fp16/fp32), g fp32 [B, T, H, K], initial_state None or fp32 [N, H, K, V],
    cu_seqlens None or int [N+1] (B == 1). Returns o [B, T, H, V] in q's dtype and the fp32
    final state [N, H, K, V] (or None).
    """
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    pb = Problem(B=B, T=T, H=H, K=K, V=v.shape[-1], N=N, scale=float(scale),
                 varlen=cu_seqlens is not None, gate=GATE_KEY,
                 has_h0=initial_state is not None, precision=None, bt=1)
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    o, ht = _recurrent(pb, q, k, v, g.astype(F32), initial_state, cu)
    return o, (ht if output_final_state else None)
