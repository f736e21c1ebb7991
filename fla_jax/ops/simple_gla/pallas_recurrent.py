"""Token-by-token simple GLA as Pallas kernels (Triton lowering), forward and backward.

Per sequence and head, with a_t = g_t + gamma (either may be absent):
    S_t = exp(a_t) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t        S: [K, V] fp32
The state lives in registers, one token per step, all arithmetic elementwise in fp32 (no
matmuls, so no precision setting applies). Suits decoding and short sequences; for long
sequences the chunked kernels (common/engine/scan.py) are faster. Kernels (program = one sequence,
one head, one block of K or V), the same split as the chunked backward:
    forward  (n, h, V-block) tokens forward:  o_t, final state
    dq       (n, h, K-block) tokens forward:  dq_t = scale S_t do_t, p_t = q_t . (scale
                                               exp(a_t) S_{t-1} do_t), fin = <dS_T,
                                               exp(a_T) S_{T-1}>
    dv       (n, h, V-block) tokens backward: dS += scale q_t^T do_t; dv_t = dS^T k_t;
                                               dS *= exp(a_t)
    dk       (n, h, K-block) tokens backward: same dS; dk_t = dS v_t, dh0,
                                               dg_t = fin + sum_{s >= t} (p_s - x_s),
                                               x_s = k_s . (exp(a_{s+1}) dS_{s+1} v_s), x_T = 0
dg_t = sum_{s >= t} (q_s.dq_s - k_s.dk_s) + <dS_T, S_T> written without the terms that cancel:
the current-token term scale (q_s.k_s)(v_s.do_s) of both dots, and k_T.(dS_T v_T), part of
<dS_T, S_T>; under strong decay what remains is O(exp(a)), where the cancelling terms are O(1).
BlockSpecs and varlen handling are shared with common/engine/scan.py; the backward wiring is this
file's (its dq kernel reads dS_T).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..common import pallas_triton as ptr
from ..common.engine import scan as pc

TUNING = {"bt": 1, "state_elems": 4096, "fwd_bv": None, "bwd_bk": None, "bwd_bv": None,
          "fwd_warps": 4, "fwd_stages": 1, "bwd_warps": 4, "bwd_stages": 1}


def _decay(refs, st, gamma, t):
    """exp(g_t + gamma) as an fp32 scalar, or None without any decay."""
    a = None
    if st.has_g:
        a = refs["g"][t].astype(jnp.float32)
    if gamma is not None:
        a = gamma if a is None else a + gamma
    return None if a is None else jnp.exp(a)


def _fwd_kernel(refs, st):
    BV = st.fwd_bv
    c0 = pl.program_id(2) * BV
    bos, L = pc._bounds(refs, st)
    gamma = pc._gamma(refs, st)
    S0 = (ptr.load_tile(refs["h0"], st.K, st.V, 0, c0) if st.has_h0
          else jnp.zeros((st.Kp, BV), jnp.float32))

    def body(i, S):
        t = bos + i
        q = ptr.load_row(refs["q"], t, st.K).astype(jnp.float32)
        k = ptr.load_row(refs["k"], t, st.K).astype(jnp.float32)
        v = ptr.load_row(refs["v"], t, st.V, c0).astype(jnp.float32)
        a = _decay(refs, st, gamma, t)
        S = (S if a is None else S * a) + k[:, None] * v[None, :]
        ptr.store_row(refs["o"], t, st.scale * jnp.sum(q[:, None] * S, 0), st.V, c0)
        return S

    S = lax.fori_loop(0, L, body, S0)
    ptr.store_tile(refs["ht"], S, st.K, st.V, 0, c0)


def _dq_kernel(refs, st):
    BK = st.bwd_bk
    kb = pl.program_id(2)
    r0 = kb * BK
    bos, L = pc._bounds(refs, st)
    gamma = pc._gamma(refs, st)
    S0 = (ptr.load_tile(refs["h0"], st.K, st.V, r0, 0) if st.has_h0
          else jnp.zeros((BK, st.Vp), jnp.float32))
    zk, zv = jnp.zeros((BK,), jnp.float32), jnp.zeros((st.Vp,), jnp.float32)

    def body(i, carry):
        # carried: P = a_{t-1} S_{t-2} and the previous token's k, v (its k^T v is added here),
        # so that after the loop P = a_T S_{T-1}
        P, k_prev, v_prev = carry
        t = bos + i
        k = ptr.load_row(refs["k"], t, st.K, r0).astype(jnp.float32)
        v = ptr.load_row(refs["v"], t, st.V).astype(jnp.float32)
        do = ptr.load_row(refs["do"], t, st.V).astype(jnp.float32)
        a = _decay(refs, st, gamma, t)
        P = P + k_prev[:, None] * v_prev[None, :]
        P = P if a is None else P * a
        # dq_t = scale (a_t S_{t-1}) do_t + scale k_t (v_t . do_t): the carried part first
        dq_in = st.scale * jnp.sum(P * do[None, :], 1)
        ptr.store_row(refs["dq"], t, dq_in + k * (st.scale * jnp.sum(v * do)), st.K, r0)
        if st.has_g:
            # q . dq without its current-token term scale (q.k)(v.do), which k . dk also
            # carries and which cancels in dg: only the carried part q . dq_in is kept
            q = ptr.load_row(refs["q"], t, st.K, r0).astype(jnp.float32)
            refs["qdq"][t] = jnp.sum(q * dq_in)
        return P, k, v

    P, _, _ = lax.fori_loop(0, L, body, (S0, zk, zv))
    if st.has_g:
        n, h = pl.program_id(0), pl.program_id(1)
        dht = ptr.load_tile(refs["dht"], st.K, st.V, r0, 0)
        refs["fin"][kb, n, h] = jnp.sum(dht * P)


def _dv_kernel(refs, st):
    BV = st.bwd_bv
    c0 = pl.program_id(2) * BV
    bos, L = pc._bounds(refs, st)
    gamma = pc._gamma(refs, st)
    dS0 = ptr.load_tile(refs["dht"], st.K, st.V, 0, c0)

    def body(i, dS):
        t = bos + L - 1 - i
        q = ptr.load_row(refs["q"], t, st.K).astype(jnp.float32)
        k = ptr.load_row(refs["k"], t, st.K).astype(jnp.float32)
        do = ptr.load_row(refs["do"], t, st.V, c0).astype(jnp.float32)
        dS = dS + st.scale * q[:, None] * do[None, :]
        ptr.store_row(refs["dv"], t, jnp.sum(dS * k[:, None], 0), st.V, c0)
        a = _decay(refs, st, gamma, t)
        return dS if a is None else dS * a

    lax.fori_loop(0, L, body, dS0)


def _dk_kernel(refs, st):
    BK = st.bwd_bk
    kb = pl.program_id(2)
    r0 = kb * BK
    bos, L = pc._bounds(refs, st)
    gamma = pc._gamma(refs, st)
    dS0 = ptr.load_tile(refs["dht"], st.K, st.V, r0, 0)
    if st.has_g:
        n, h = pl.program_id(0), pl.program_id(1)
        carry0 = jnp.where(kb == 0, refs["cterm"][n, h], 0.0).astype(jnp.float32)
    else:
        carry0 = jnp.zeros((), jnp.float32)

    def body(i, state):
        dS, carry = state
        t = bos + L - 1 - i
        q = ptr.load_row(refs["q"], t, st.K, r0).astype(jnp.float32)
        k = ptr.load_row(refs["k"], t, st.K, r0).astype(jnp.float32)
        v = ptr.load_row(refs["v"], t, st.V).astype(jnp.float32)
        do = ptr.load_row(refs["do"], t, st.V).astype(jnp.float32)
        # dk_t = (a_{t+1} dS_{t+1}) v_t + scale q_t (do_t . v_t): the carried part first
        dk_in = jnp.sum(dS * v[None, :], 1)
        dS = dS + st.scale * q[:, None] * do[None, :]
        ptr.store_row(refs["dk"], t, dk_in + q * (st.scale * jnp.sum(do * v)), st.K, r0)
        if st.has_g:
            # k . dk without the current-token term (see _dq_kernel); at the last token the
            # carried part k_T dS_T v_T is left out too: it would cancel <dS_T, S_T>, O(1);
            # the carry starts from fin = <dS_T, a_T S_{T-1}> instead
            kdk = jnp.where(i > 0, jnp.sum(k * dk_in), 0.0)
            carry = carry + refs["qdq"][t] - kdk
            refs["dg"][t] = carry
        a = _decay(refs, st, gamma, t)
        return (dS if a is None else dS * a), carry

    dS, _ = lax.fori_loop(0, L, body, (dS0, carry0))
    if st.has_h0:
        ptr.store_tile(refs["dh0"], dS, st.K, st.V, r0, 0)


_KERNELS = pc.Kernels(fwd=_fwd_kernel, dq=_dq_kernel, dv=_dv_kernel, dk=_dk_kernel,
                      name="simple_gla_recurrent")


def _backward(st, q, k, v, g, gamma, h0, cu, do, dht):
    """engine/scan.scan_bwd's three kernels and BlockSpecs, except that the dq kernel also
    reads dS_T and writes fin [NK, N, H] (the shares of <dS_T, a_T S_{T-1}>), which starts
    the dk kernel's dg carry. Returns dq, dk, dv (input dtypes), dg fp32 or None, dh0."""
    NK = pl.cdiv(st.K, st.bwd_bk)
    NV = pl.cdiv(st.V, st.bwd_bv)
    f32 = jnp.float32
    common = pc._common_inputs(st, cu, g, gamma)
    part = jax.ShapeDtypeStruct((NK,) + g.shape, f32) if st.has_g else None
    row_tile = pc._state_spec(st.bwd_bk, st.Vp, pc._same, pc._zero)

    ins = [("q", q, pc._seq_spec(st, st.bwd_bk, pc._same)),
           ("k", k, pc._seq_spec(st, st.bwd_bk, pc._same)),
           ("v", v, pc._seq_spec(st, st.Vp, pc._zero)),
           ("do", do, pc._seq_spec(st, st.Vp, pc._zero))] + common
    if st.has_h0:
        ins.append(("h0", h0, row_tile))
    outs = [("dq", jax.ShapeDtypeStruct(q.shape, q.dtype), pc._seq_spec(st, st.bwd_bk, pc._same))]
    if st.has_g:
        ins.append(("dht", dht, row_tile))
        fin = jax.ShapeDtypeStruct((NK, st.N, st.H), f32)
        outs += [("qdq", part, pc._part_spec(st)), ("fin", fin, pc._full_spec(fin))]
    r = pc._call(_KERNELS.dq, st, (st.N, st.H, NK), ins, outs, st.bwd_warps, st.bwd_stages,
                 _KERNELS.name + "_bwd_dq")

    ins = [("q", q, pc._seq_spec(st, st.Kp, pc._zero)), ("k", k, pc._seq_spec(st, st.Kp, pc._zero)),
           ("do", do, pc._seq_spec(st, st.bwd_bv, pc._same))] + common
    ins.append(("dht", dht, pc._state_spec(st.Kp, st.bwd_bv, pc._zero, pc._same)))
    outs = [("dv", jax.ShapeDtypeStruct(v.shape, v.dtype), pc._seq_spec(st, st.bwd_bv, pc._same))]
    dv = pc._call(_KERNELS.dv, st, (st.N, st.H, NV), ins, outs, st.bwd_warps, st.bwd_stages,
                  _KERNELS.name + "_bwd_dv")["dv"]

    ins = [("q", q, pc._seq_spec(st, st.bwd_bk, pc._same)),
           ("k", k, pc._seq_spec(st, st.bwd_bk, pc._same)),
           ("v", v, pc._seq_spec(st, st.Vp, pc._zero)),
           ("do", do, pc._seq_spec(st, st.Vp, pc._zero))] + common
    if st.has_g:
        cterm = jnp.sum(r["fin"], axis=0)                 # [N, H]: <dS_T, a_T S_{T-1}>
        ins += [("qdq", r["qdq"], pc._part_spec(st)), ("cterm", cterm, pc._full_spec(cterm))]
    ins.append(("dht", dht, row_tile))
    outs = [("dk", jax.ShapeDtypeStruct(k.shape, k.dtype), pc._seq_spec(st, st.bwd_bk, pc._same))]
    if st.has_h0:
        outs.append(("dh0", jax.ShapeDtypeStruct(h0.shape, f32), row_tile))
    if st.has_g:
        outs.append(("dg", part, pc._part_spec(st)))
    rk = pc._call(_KERNELS.dk, st, (st.N, st.H, NK), ins, outs, st.bwd_warps, st.bwd_stages,
                  _KERNELS.name + "_bwd_dk")
    dg = None
    if st.has_g:
        dg = rk["dg"][0] if NK == 1 else jnp.sum(rk["dg"], axis=0)
    return r["dq"], rk["dk"], dv, dg, (rk["dh0"] if st.has_h0 else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _recurrent(st, q, k, v, g, gamma, h0, cu):
    return pc.scan_fwd(_KERNELS, st, q, k, v, g, gamma, h0, cu)


def _recurrent_fwd(st, q, k, v, g, gamma, h0, cu):
    o, ht = pc.scan_fwd(_KERNELS, st, q, k, v, g, gamma, h0, cu)
    return (o, ht), (q, k, v, g, gamma, h0, cu)


def _recurrent_bwd(st, res, cts):
    q, k, v, g, gamma, h0, cu = res
    do, dht = cts
    dq, dk, dv, dg, dh0 = _backward(st, q, k, v, g, gamma, h0, cu, do, dht.astype(jnp.float32))
    dgamma = None if gamma is None else jnp.zeros_like(gamma)
    return dq, dk, dv, dg, dgamma, dh0, None


_recurrent.defvjp(_recurrent_fwd, _recurrent_bwd)


def fused_recurrent_simple_gla_pallas(q, k, v, *, g=None, g_gamma=None, scale,
                                      initial_state=None, output_final_state=False,
                                      cu_seqlens=None):
    """Pallas (Triton lowering) token-by-token simple GLA; runs interpreted off-GPU.

    Args and returns as `pallas_chunk.chunk_simple_gla_pallas`: q, k [B, T, H, K], v
    [B, T, H, V] (bf16/fp16/fp32), g None or fp32 [B, T, H], g_gamma None or fp32 [H],
    initial_state None or fp32 [N, H, K, V], cu_seqlens None or int [N+1] (B == 1).
    Returns o [B, T, H, V] in q's dtype and the fp32 final state [N, H, K, V] (or None).
    """
    st = pc.make_static(q, v, g, g_gamma, initial_state, cu_seqlens, scale, TUNING)
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    o, ht = _recurrent(st, q, k, v, g, g_gamma, initial_state, cu)
    return o, (ht if output_final_state else None)
