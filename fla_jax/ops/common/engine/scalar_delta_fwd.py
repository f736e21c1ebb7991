"""The engine's scalar-gate delta rule, forward state / output kernel (Pallas, Triton lowering).

`_state_out_kernel`: one program per (sequence, value head, block of BV value columns),
sequential over the sequence's chunks with the state S [K, BV] fp32 in registers (W, U from
scalar_wy_fwd.py):
    v_new = U - W S
    o     = scale (Gamma * (Q S) + tril(Q K^T * exp(gc_i - gc_j)) v_new)
    S     = exp(gc_last) S + (K * exp(gc_last - gc))^T v_new
For training it also stores the chunk start states h (q's dtype) and v_new, the residuals of
the backward (scalar_delta_bwd.py). (Triton: chunk_h and chunk_o, two kernels.)
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..pallas_delta_layout import kdot, l2norm_fwd
from .scalar_wy_fwd import first_entry, masked_rows, store_rows

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
