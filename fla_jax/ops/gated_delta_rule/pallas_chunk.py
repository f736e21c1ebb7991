"""Chunked gated delta rule (WY / UT transform) as Pallas kernels.

Forward, chunks of BT tokens (64; smaller where fp32 / 256-wide tiles would not fit shared
memory: common/pallas_delta_tiles.py picks BT, value blocks, warps and stages from K, V, dtype):
  1. `wy_prep` (fla_jax/ops/common/pallas_wy_prep.py), parallel over chunks: W, U per chunk
     (and for training Tm = (I + A)^-1 per chunk, which the backward reuses).
  2. `_state_out_kernel`, one program per (sequence, value head, block of BV value columns),
     sequential over the sequence's chunks with the state S [K, BV] fp32 in registers:
        v_new = U - W S
        o     = scale (Gamma * (Q S) + tril(Q K^T * exp(gc_i - gc_j)) v_new)
        S     = exp(gc_last) S + (K * exp(gc_last - gc))^T v_new
     For training it also stores the chunk start states h (q's dtype) and v_new, the
     residuals of the backward.
Backward (default): chunk-parallel kernels of common/pallas_delta_chunk_bwd.py: a reverse
sequential pass over chunks for the state gradients dh and dv_new, then one parallel kernel per
chunk for dq, dk, dv, dbeta, dg (WY backward with the forward's Tm). `backward="recurrent"` keeps the exact token-serial backward
kernel of pallas_recurrent.py (forward then stores the fp32 u_t = v_t - k_t S'_t instead).
q, k, v are read in place ([B, T, H, D] viewed as [B*T, H, D]); varlen is handled inside the
kernels through cu_seqlens (may be traced).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..common.dispatch import pallas_interpret
from ..common.pallas_delta_chunk_bwd import chunk_dh, chunk_first, chunk_grads
from ..common.pallas_delta_layout import (dot_precision, kdot, group_sum, l2norm_bwd, l2norm_fwd,
                                          next_pow2, pad_last, sequence_bounds, triton_params)
from ..common.pallas_delta_tiles import delta_tiles
from ..common.pallas_wy_prep import (chunk_table, first_entry, masked_rows, store_rows,
                                     wy_prep)
from .pallas_recurrent import _backward as recurrent_backward

F32 = jnp.float32


def _state_out_kernel(*refs, scale, G, BT, BV, has_g, has_h0, l2norm, resid, prec):
    it = iter(refs)
    cu_ref, first_ref, q_ref, k_ref, v_ref, w_ref, uu_ref = (next(it) for _ in range(7))
    g_ref = next(it) if has_g else None
    h0_ref = next(it) if has_h0 else None
    o_ref, ht_ref = next(it), next(it)
    save_u = resid == "u"
    u_ref = next(it) if save_u else None
    h_ref, vn_ref = (next(it), next(it)) if resid == "h" else (None, None)

    n, hv, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h = hv // G
    vs = pl.ds(iv * BV, BV)
    bos, eos = cu_ref[n], cu_ref[n + 1]
    K = q_ref.shape[-1]
    dt = q_ref.dtype
    r = lax.broadcasted_iota(jnp.int32, (BT, BT), 0)
    c = lax.broadcasted_iota(jnp.int32, (BT, BT), 1)
    S = h0_ref[n, hv, :, vs].astype(F32) if has_h0 else jnp.zeros((K, BV), F32)

    def body(i, S):
        st = bos + i * BT
        q = masked_rows(q_ref, st, eos, BT, h)
        k = masked_rows(k_ref, st, eos, BT, h)
        if l2norm:
            q, k = l2norm_fwd(q).astype(dt), l2norm_fwd(k).astype(dt)
        w = masked_rows(w_ref, st, eos, BT, hv)
        uu = masked_rows(uu_ref, st, eos, BT, hv, vs).astype(F32)
        if has_g:
            gb = masked_rows(g_ref, st, eos, BT, hv)
            gc = jnp.cumsum(gb)
            g_last = jnp.sum(gb)
            # g_last - gc_i as a direct suffix sum (exact for the recent tokens that dominate)
            suffix = jnp.sum(jnp.where(c > r, gb[None, :], 0.0), axis=1)
        else:
            gc = jnp.zeros((BT,), F32)
            g_last = jnp.zeros((), F32)
            suffix = gc
        Sd = S.astype(dt)
        v_new = uu - jnp.exp(first_entry(gc)) * kdot(w, Sd, prec)   # W stored as exp(-gc_0) W
        vn_d = v_new.astype(dt)
        if h_ref is not None:   # residuals of the chunk-parallel backward
            h_ref[first_ref[n] + i, hv, :, vs] = Sd
            store_rows(vn_ref, vn_d, st, eos, hv, vs)
        diff = jnp.where(r >= c, gc[:, None] - gc[None, :], 0.0)
        decay = jnp.where(r >= c, jnp.exp(diff), 0.0)
        qk = kdot(q, k.T, prec) * decay
        o = jnp.exp(gc)[:, None] * kdot(q, Sd, prec)
        o = o + kdot(qk.astype(dt), vn_d, prec)
        store_rows(o_ref, scale * o, st, eos, hv, vs)
        if save_u:   # the backward's residual, from fp32 operands: u = v - k S'
            v = masked_rows(v_ref, st, eos, BT, hv, vs).astype(F32)
            k32 = k.astype(F32)
            kk = jnp.where(r > c, kdot(k32, k32.T, prec) * decay, 0.0)
            pred = jnp.exp(gc)[:, None] * kdot(k32, S, prec) + kdot(kk, v_new, prec)
            store_rows(u_ref, v - pred, st, eos, hv, vs)
        kd = (k.astype(F32) * jnp.exp(suffix)[:, None]).astype(dt)
        return jnp.exp(g_last) * S + kdot(kd.T, vn_d, prec)

    S = lax.fori_loop(0, (eos - bos + BT - 1) // BT, body, S)
    ht_ref[n, hv, :, vs] = S


def _pad_rows(interpret, BT, *xs):
    """The interpreter clamps out-of-range windows instead of masking them: give every chunk
    window real rows to read (the GPU path reads the arrays in place)."""
    if not interpret:
        return xs
    return tuple(None if x is None else jnp.pad(x, [(0, BT)] + [(0, 0)] * (x.ndim - 1))
                 for x in xs)


def _forward(q, k, v, g, beta, h0, cu, *, scale, l2norm, resid):
    """q, k: [R, H, K]; v: [R, HV, V]; g (or None), beta: [R, HV] fp32; h0: [N, HV, K, V] fp32
    or None; cu int32 [N+1]. resid: None, "u" (token-serial backward: u fp32 [R, HV, V]) or
    "h" (chunk backward: w, U [rows, HV, K|V], v_new [rows, HV, V] and the chunk start
    states h [R // BT + N, HV, K, V] and Tm [R // BT + N, HV, BT, BT], all in q's dtype;
    rows = R, + BT when interpreted).
    Returns o [R, HV, V], ht [N, HV, K, V] fp32 and the residual tuple (empty for None)."""
    R, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu.shape[0] - 1
    tiles = delta_tiles(K, V, q.dtype)
    BT = tiles.BT
    interpret = pallas_interpret()
    q, k, v, g, beta = _pad_rows(interpret, BT, q, k, v, g, beta)
    rows = q.shape[0]
    table = chunk_table(cu, R, BT)
    first = chunk_first(cu, BT)
    prep = wy_prep(k, v, g, beta, table, H_ratio=HV // H, BT=BT, l2norm=l2norm, out_rows=rows,
                   num_warps=tiles.wy[0], num_stages=tiles.wy[1], want_tm=resid == "h")
    w, uu = prep[:2]
    BV, num_warps, num_stages = min(V, tiles.state[0]), tiles.state[1], tiles.state[2]
    kernel = functools.partial(_state_out_kernel, scale=scale, G=HV // H, BT=BT, BV=BV,
                               has_g=g is not None, has_h0=h0 is not None, l2norm=l2norm,
                               resid=resid, prec=dot_precision(interpret))
    ins = [x for x in (cu, first, q, k, v, w, uu, g, h0) if x is not None]
    out_shape = [jax.ShapeDtypeStruct((rows, HV, V), q.dtype),
                 jax.ShapeDtypeStruct((N, HV, K, V), F32)]
    if resid == "u":
        out_shape.append(jax.ShapeDtypeStruct((rows, HV, V), F32))
    elif resid == "h":
        out_shape += [jax.ShapeDtypeStruct((table.shape[0], HV, K, V), q.dtype),
                      jax.ShapeDtypeStruct((rows, HV, V), q.dtype)]
    params = None if interpret else triton_params(num_warps, num_stages)
    outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(N, HV, V // BV),
                          interpret=interpret, name="chunk_gdn_state_out",
                          compiler_params=params)(*ins)
    o = outs[0][:R]
    if resid == "u":
        return o, outs[1], (outs[2][:R],)
    if resid == "h":
        return o, outs[1], (w, uu, outs[3], outs[2], prep[2])
    return o, outs[1], ()


def _chunk_backward(q, k, v, g, beta, h0, cu, w, uu, vn, hs, tm, do, dht, *, scale, l2norm):
    """Chunk-parallel backward (pallas_delta_chunk_bwd.py). Returns per-value-head fp32
    dq, dk [R, HV, K], dv [R, HV, V] (v's dtype), dbeta [R, HV], dg [R, HV] (or None),
    dh0 (or None)."""
    R = q.shape[0]
    tiles = delta_tiles(q.shape[2], v.shape[2], q.dtype)
    BT = tiles.BT
    interpret = pallas_interpret()
    q, k, v, g, beta, do = _pad_rows(interpret, BT, q, k, v, g, beta, do)
    table = chunk_table(cu, R, BT)
    first = chunk_first(cu, BT)
    dh, dvn, dh0 = chunk_dh(q, k, w, do, g, dht, cu, first, n_slots=table.shape[0],
                            has_h0=h0 is not None, scale=scale, l2norm=l2norm, BT=BT,
                            tile=tiles.dh)
    dq, dk, dv, db, dg = chunk_grads(q, k, v, g, beta, do, w, uu, vn, hs, dh, dvn, tm, table,
                                     scale=scale, l2norm=l2norm, BT=BT, tile=tiles.grads)
    return dq[:R], dk[:R], dv[:R], db[:R], (None if dg is None else dg[:R]), dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _chunk(q, k, v, g, beta, h0, cu, scale, l2norm, want_ht, backward):
    o, ht, _ = _forward(q, k, v, g, beta, h0, cu, scale=scale, l2norm=l2norm, resid=None)
    return o, ht


def _chunk_fwd(q, k, v, g, beta, h0, cu, scale, l2norm, want_ht, backward):
    resid = "u" if backward == "recurrent" else "h"
    o, ht, extra = _forward(q, k, v, g, beta, h0, cu, scale=scale, l2norm=l2norm, resid=resid)
    return (o, ht), (q, k, v, g, beta, h0, cu) + extra


def _chunk_bwd(scale, l2norm, want_ht, backward, res, cts):
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
        dq, dk, dv, db, dg, dh0 = _chunk_backward(q, k, v, g, beta, h0, cu, w, uu, vn, hs, tm,
                                                  do, dht, scale=scale, l2norm=l2norm)
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
                   bool(output_final_state), backward)
    o = o[..., :V].reshape(B, T, HV, V)
    if not output_final_state:
        return o, None
    return o, ht[:, :, :K, :V]
