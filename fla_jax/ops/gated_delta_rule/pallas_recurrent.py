"""Fused recurrent (token-by-token) gated delta rule: Pallas kernels, forward and backward.

Per sequence n and value head hv (q/k head h = hv // (HV // H)), one program per block of BV
value columns keeps S[:, block] (fp32 [K, BV]) in registers and walks the tokens:
    S' = exp(g_t) S;  u_t = v_t - k_t S';  S = S' + beta_t k_t^T u_t;  o_t = scale q_t S
(g absent = the plain delta rule). The forward used for training also writes u_t (fp32).

Backward (same grid), with D the gradient of the loss w.r.t. the state after token t:
  loop 1, tokens in reverse:  xk = k_t D (D from the later tokens);  y_t = beta_t v_t . xk;
      D += scale q_t^T do_t;  dvn = xk + scale (q_t . k_t) do_t;  dv_t = beta_t dvn;
      dk_t = D (beta_t u_t)^T;  dbeta_t = dvn . u_t;
      D = exp(g_t) (D - k_t^T dv_t)                      -> dh0 = D at the end
  loop 2, tokens forward (recomputes S from h0 and u):
      S' = exp(g_t) S;  dk_t += S' (-dv_t);  sd = S' do_t;
      dq_t = scale (sd + beta_t (u_t . do_t) k_t);  S = S' + beta_t k_t^T u_t;
      dg_t = c;  c += y_t - scale (q_t . sd - beta_t (q_t . k_t)(k_t . sd))
      (c starts at <h0, dh0>)
  This is the scalar identity dg_t = <exp(g_t) S_{t-1}, dS'_t> = c_t, c_{t+1} = c_t + v.dv -
  q.dq, unrolled, so no per-token state is ever stored. q.dq and v.dv share the term
  scale beta (q.k)(v.do), O(1), which cancels; under strong decay the rest is O(exp(g)), so
  the kernel never forms it: y_t and the term subtracted are both O(exp(g)).
Partials over value blocks (dq, dk, dbeta, dg) and over grouped value heads are summed in the
wrapper; the l2norm gradient is applied there too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..common.dispatch import pallas_interpret
from ..common.pallas_delta_layout import (dot_precision, group_sum, l2norm_bwd, l2norm_fwd,
                                          next_pow2, pad_last, sequence_bounds, triton_params)

F32 = jnp.float32


def _block_v(V: int) -> int:
    return min(V, 32)


def _barrier(interpret: bool):
    """Make this program's global stores visible to all its threads before re-reading."""
    if not interpret:
        from jax.experimental.pallas import triton as plt
        plt.debug_barrier()


def _load_qk(ref, t, h, l2norm):
    x = ref[t, h, :].astype(F32)
    return l2norm_fwd(x) if l2norm else x


# ----------------------------------------------------------------------------------- forward
def _fwd_kernel(*refs, scale, G, BV, has_g, has_h0, l2norm, save_u):
    it = iter(refs)
    cu_ref, q_ref, k_ref, v_ref = next(it), next(it), next(it), next(it)
    g_ref = next(it) if has_g else None
    b_ref = next(it)
    h0_ref = next(it) if has_h0 else None
    o_ref, ht_ref = next(it), next(it)
    u_ref = next(it) if save_u else None

    n, hv, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h = hv // G
    vs = pl.ds(iv * BV, BV)
    bos, eos = cu_ref[n], cu_ref[n + 1]
    K = q_ref.shape[-1]
    S = h0_ref[n, hv, :, vs].astype(F32) if has_h0 else jnp.zeros((K, BV), F32)

    def body(t, S):
        q = _load_qk(q_ref, t, h, l2norm)
        k = _load_qk(k_ref, t, h, l2norm)
        v = v_ref[t, hv, vs].astype(F32)
        beta = b_ref[t, hv]
        if has_g:
            S = S * jnp.exp(g_ref[t, hv])
        u = v - jnp.sum(k[:, None] * S, axis=0)
        S = S + (beta * k)[:, None] * u[None, :]
        o_ref[t, hv, vs] = (scale * jnp.sum(q[:, None] * S, axis=0)).astype(o_ref.dtype)
        if save_u:
            u_ref[t, hv, vs] = u
        return S

    S = lax.fori_loop(bos, eos, body, S)
    ht_ref[n, hv, :, vs] = S


def _forward(q, k, v, g, beta, h0, cu, *, scale, l2norm, save_u):
    """q, k: [BT, H, K]; v: [BT, HV, V]; g, beta: [BT, HV] fp32; h0: [N, HV, K, V] fp32 or
    None; cu: int32 [N+1]. Returns o [BT, HV, V] (q's dtype), ht [N, HV, K, V] fp32 and
    u [BT, HV, V] fp32 (or None)."""
    BT, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu.shape[0] - 1
    BV = _block_v(V)
    interpret = pallas_interpret()
    kernel = functools.partial(_fwd_kernel, scale=scale, G=HV // H, BV=BV, has_g=g is not None,
                               has_h0=h0 is not None, l2norm=l2norm, save_u=save_u)
    ins = [x for x in (cu, q, k, v, g, beta, h0) if x is not None]
    out_shape = [jax.ShapeDtypeStruct((BT, HV, V), q.dtype),
                 jax.ShapeDtypeStruct((N, HV, K, V), F32)]
    if save_u:
        out_shape.append(jax.ShapeDtypeStruct((BT, HV, V), F32))
    outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(N, HV, V // BV),
                          interpret=interpret, name="fused_recurrent_gdn_fwd",
                          compiler_params=None if interpret else triton_params(4))(*ins)
    return outs[0], outs[1], (outs[2] if save_u else None)


# ---------------------------------------------------------------------------------- backward
def _bwd_kernel(*refs, scale, G, BV, has_g, has_h0, has_dht, l2norm, interpret):
    it = iter(refs)
    cu_ref, q_ref, k_ref, v_ref = next(it), next(it), next(it), next(it)
    g_ref = next(it) if has_g else None
    b_ref = next(it)
    h0_ref = next(it) if has_h0 else None
    do_ref = next(it)
    dht_ref = next(it) if has_dht else None
    u_ref = next(it)
    dq_ref, dk_ref, dv_ref, db_ref, dg_ref = next(it), next(it), next(it), next(it), next(it)
    dh0_ref = next(it) if has_h0 else None

    n, hv, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h = hv // G
    vs = pl.ds(iv * BV, BV)
    bos, eos = cu_ref[n], cu_ref[n + 1]
    K = q_ref.shape[-1]
    D = dht_ref[n, hv, :, vs].astype(F32) if has_dht else jnp.zeros((K, BV), F32)

    def reverse(i, D):
        t = eos - 1 - i
        q = _load_qk(q_ref, t, h, l2norm)
        k = _load_qk(k_ref, t, h, l2norm)
        v = v_ref[t, hv, vs].astype(F32)
        do = do_ref[t, hv, vs].astype(F32)
        u = u_ref[t, hv, vs]
        beta = b_ref[t, hv]
        xk = jnp.sum(k[:, None] * D, axis=0)
        dg_ref[iv, t, hv] = beta * jnp.sum(v * xk)
        D = D + (scale * q)[:, None] * do[None, :]
        dvn = xk + (scale * jnp.sum(q * k)) * do
        dv = beta * dvn
        dk_ref[iv, t, hv, :] = jnp.sum(D * (beta * u)[None, :], axis=1)
        dv_ref[t, hv, vs] = dv
        db_ref[iv, t, hv] = jnp.sum(dvn * u)
        D = D - k[:, None] * dv[None, :]
        if has_g:
            D = D * jnp.exp(g_ref[t, hv])
        return D

    D = lax.fori_loop(0, eos - bos, reverse, D)
    if has_h0:
        S = h0_ref[n, hv, :, vs].astype(F32)
        dh0_ref[n, hv, :, vs] = D
        c = jnp.sum(S * D)
    else:
        S = jnp.zeros((K, BV), F32)
        c = jnp.zeros((), F32)
    _barrier(interpret)

    def forward(t, carry):
        S, c = carry
        q = _load_qk(q_ref, t, h, l2norm)
        k = _load_qk(k_ref, t, h, l2norm)
        do = do_ref[t, hv, vs].astype(F32)
        u = u_ref[t, hv, vs]
        dv = dv_ref[t, hv, vs]
        beta = b_ref[t, hv]
        if has_g:
            S = S * jnp.exp(g_ref[t, hv])
        dk_ref[iv, t, hv, :] = dk_ref[iv, t, hv, :] - jnp.sum(S * dv[None, :], axis=1)
        sd = jnp.sum(S * do[None, :], axis=1)
        dq_ref[iv, t, hv, :] = scale * (sd + (beta * jnp.sum(u * do)) * k)
        S = S + (beta * k)[:, None] * u[None, :]
        y = dg_ref[iv, t, hv]
        dg_ref[iv, t, hv] = c
        a = scale * (jnp.sum(q * sd) - beta * jnp.sum(q * k) * jnp.sum(k * sd))
        return S, c + y - a

    lax.fori_loop(bos, eos, forward, (S, c))


def _backward(q, k, v, g, beta, h0, cu, u, do, dht, *, scale, l2norm):
    """Returns per-value-head fp32 gradients: dq, dk [BT, HV, K] (w.r.t. the normalised q/k
    when l2norm), dv [BT, HV, V], dbeta [BT, HV], dg [BT, HV] (or None), dh0 (or None)."""
    BT, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu.shape[0] - 1
    BV = _block_v(V)
    NV = V // BV
    interpret = pallas_interpret()
    kernel = functools.partial(_bwd_kernel, scale=scale, G=HV // H, BV=BV,
                               has_g=g is not None, has_h0=h0 is not None,
                               has_dht=dht is not None, l2norm=l2norm, interpret=interpret)
    ins = [x for x in (cu, q, k, v, g, beta, h0, do, dht, u) if x is not None]
    out_shape = [jax.ShapeDtypeStruct((NV, BT, HV, K), F32),
                 jax.ShapeDtypeStruct((NV, BT, HV, K), F32),
                 jax.ShapeDtypeStruct((BT, HV, V), F32),
                 jax.ShapeDtypeStruct((NV, BT, HV), F32),
                 jax.ShapeDtypeStruct((NV, BT, HV), F32)]
    if h0 is not None:
        out_shape.append(jax.ShapeDtypeStruct((N, HV, K, V), F32))
    outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(N, HV, NV),
                          interpret=interpret, name="fused_recurrent_gdn_bwd",
                          compiler_params=None if interpret else triton_params(4))(*ins)
    dq, dk, dv, db, dg = outs[0].sum(0), outs[1].sum(0), outs[2], outs[3].sum(0), outs[4].sum(0)
    return dq, dk, dv, db, (dg if g is not None else None), (outs[5] if h0 is not None else None)


# ------------------------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _recurrent(q, k, v, g, beta, h0, cu, scale, l2norm, want_ht):
    o, ht, _ = _forward(q, k, v, g, beta, h0, cu, scale=scale, l2norm=l2norm, save_u=False)
    return o, ht


def _recurrent_fwd(q, k, v, g, beta, h0, cu, scale, l2norm, want_ht):
    o, ht, u = _forward(q, k, v, g, beta, h0, cu, scale=scale, l2norm=l2norm, save_u=True)
    return (o, ht), (q, k, v, g, beta, h0, cu, u)


def _recurrent_bwd(scale, l2norm, want_ht, res, cts):
    q, k, v, g, beta, h0, cu, u = res
    do, dht = cts
    H = q.shape[1]
    dq, dk, dv, db, dg, dh0 = _backward(q, k, v, g, beta, h0, cu, u, do,
                                        dht.astype(F32) if want_ht else None,
                                        scale=scale, l2norm=l2norm)
    dq, dk = group_sum(dq, H), group_sum(dk, H)
    if l2norm:
        dq, dk = l2norm_bwd(q, dq), l2norm_bwd(k, dk)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if g is None else dg.astype(g.dtype), db.astype(beta.dtype),
            None if h0 is None else dh0.astype(h0.dtype), None)


_recurrent.defvjp(_recurrent_fwd, _recurrent_bwd)


def fused_recurrent_gated_delta_rule_pallas(q, k, v, *, g, beta, scale, initial_state,
                                            output_final_state, cu_seqlens,
                                            use_qk_l2norm_in_kernel=False):
    """Token-by-token gated delta rule as Pallas kernels (Triton lowering; interpreted on CPU).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0); one dtype in {bf16, fp16, fp32}.
        g: [B, T, HV] fp32 log-decay, or None (plain delta rule); beta: [B, T, HV] fp32.
        scale: float. initial_state: None or [N, HV, K, V] fp32. cu_seqlens: None or int
        [N+1] (B == 1; may be traced). use_qk_l2norm_in_kernel: normalise q, k over K.
    Returns:
        o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] fp32 (None unless
        output_final_state). Differentiable w.r.t. q, k, v, g, beta, initial_state.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    Kp, Vp = next_pow2(K), next_pow2(V)
    cu = sequence_bounds(B, T, cu_seqlens)
    qf = pad_last(q.reshape(B * T, H, K), Kp)
    kf = pad_last(k.reshape(B * T, H, K), Kp)
    vf = pad_last(v.reshape(B * T, HV, V), Vp)
    gf = None if g is None else g.reshape(B * T, HV)
    bf = beta.reshape(B * T, HV)
    h0 = initial_state
    if h0 is not None and (Kp != K or Vp != V):
        h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
    o, ht = _recurrent(qf, kf, vf, gf, bf, h0, cu, float(scale), bool(use_qk_l2norm_in_kernel),
                       bool(output_final_state))
    o = o[..., :V].reshape(B, T, HV, V)
    if not output_final_state:
        return o, None
    return o, ht[:, :, :K, :V]
