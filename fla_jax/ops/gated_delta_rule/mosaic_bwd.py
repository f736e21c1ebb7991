"""Backward of the Mosaic GPU gated delta rule: the forward kernel's residuals (states
entering each chunk, v_new; saved by the forward, else recomputed), the Mosaic reverse pass
(mosaic_bwd_kernel.py), then chunk-parallel XLA for everything local to a chunk.

Per chunk the op is  o = scale (Gamma q S + P v_new),  v_new = u - w S,
S' = exp(G_last) S + kd^T v_new, with (w, u, kd, exp(G_last)) functions of (k, v, beta, G)
(WY form). Given the reverse pass' L (cotangent of S') and dv_new, the cotangents of the
per-chunk factors are  dw = -dv_new S^T, du = dv_new, dkd = v_new L^T,
d exp(G_last) = <L, S>; one jax.vjp of the local function (fp32, the library's matmul
precision) turns them and do into dq, dk, dv, dbeta and dG (then dg by a reverse cumsum).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common.compute_operands import einsum
from ..common.pallas_delta_layout import l2norm_fwd
from ..common.unit_lower_inverse import unit_lower_inverse
from .mosaic_bwd_kernel import reverse_states
from .mosaic_fwd_kernel import C, fused_forward
from .mosaic_layout import (LOG2E, from_rows, gate_free_inverse, gate_vectors, l2norm, plan,
                            to_rows)

F32 = jnp.float32
LOCAL_MATMUL = "fp32"   # "input": the chunk-local matmuls take operands (and cotangents) in
#                         q's dtype with fp32 accumulation, as FLA's kernels do


def _dot16(spec, a, b):
    """einsum of 16-bit a, b with fp32 accumulation (XLA:CPU has no 16-bit x 16-bit -> fp32
    dot: there the rounded operands are multiplied in fp32, which gives the same products)."""
    if jax.default_backend() == "cpu":
        return jnp.einsum(spec, a.astype(F32), b.astype(F32), precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum(spec, a, b, preferred_element_type=F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _mm16(spec, a, b, cdt):
    """einsum(spec, a, b) of fp32 a, b with operands rounded to cdt, fp32 accumulation; its
    vjp rounds the cotangent to cdt as well."""
    return _dot16(spec, a.astype(cdt), b.astype(cdt))


def _mm16_fwd(spec, a, b, cdt):
    return _mm16(spec, a, b, cdt), (a.astype(cdt), b.astype(cdt))


def _mm16_bwd(spec, cdt, res, ct):
    a, b = res
    ins, z = spec.split("->")
    x, y = ins.split(",")
    ct = ct.astype(cdt)
    da = _dot16(f"{z},{y}->{x}", ct, b)
    db = _dot16(f"{x},{z}->{y}", a, ct)
    return da, db


_mm16.defvjp(_mm16_fwd, _mm16_bwd)


def _chunks(x):
    """[R, (H,) ...] rows -> [NC, C, ...]."""
    return x.reshape(x.shape[0] // C, C, *x.shape[1:])


def _local(q, k, v, b, G, S, vn, *, scale, cdt=None):
    """The per-chunk factors, all [NC, C, HV, ...] fp32 (S: [NC, HV, K, V] entering states,
    vn: [NC, C, HV, V] v_new, both held constant). Returns (o_loc, w, u, kd, gam).
    cdt: None (fp32 matmuls at the library's precision) or the 16-bit operand dtype."""
    mm = einsum if cdt is None else (lambda spec, x, y: _mm16(spec, x, y, cdt))
    idx = jnp.arange(C)
    keep = idx[:, None] >= idx[None, :]
    Gh = jnp.moveaxis(G, 1, -1)                                          # [NC, HV, C]
    D = jnp.exp(jnp.where(keep, Gh[..., :, None] - Gh[..., None, :], -jnp.inf))
    kk = mm("nihk,njhk->nhij", k, k)
    bh = jnp.moveaxis(b, 1, -1)
    t0 = unit_lower_inverse(kk * bh[..., :, None])
    tg = t0 * D
    gam_tok = jnp.exp(G)[..., None]                                     # [NC, C, HV, 1]
    w = mm("nhij,njhk->nihk", tg, (b[..., None] * gam_tok) * k)
    u = mm("nhij,njhv->nihv", tg, b[..., None] * v)
    g_last = G[:, -1:, :]                                               # [NC, 1, HV]
    kd = k * jnp.exp(g_last - G)[..., None]
    gam = jnp.exp(G[:, -1, :])                                          # [NC, HV]
    p = mm("nihk,njhk->nhij", q, k) * D
    o = gam_tok * mm("nihk,nhkv->nihv", q, S) + mm("nhij,njhv->nihv", p, vn)
    return o * scale, w, u, kd, gam


def backward(q, k, v, g, beta, h0, cu_seqlens, do, dht, *, scale: float, l2: bool,
             resid=None):
    """Cotangents (dq, dk, dv, dg or None, dbeta, dh0 or None) of the Mosaic forward, each in
    its input's dtype; shapes as in mosaic_chunk.forward. do: [B, T, HV, V];
    dht: [N, HV, K, V] fp32. resid: None (run the forward kernel again) or its residuals
    (hs [NC, HV, V, K], vnT [HV, V, R]) from mosaic_chunk.forward(..., residuals=True)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G_ = HV // H
    dtype = q.dtype
    qn, kn = (l2norm(q), l2norm(k)) if l2 else (q, k)
    lay, table = plan(B, T, cu_seqlens)
    qr, kr, vr = to_rows(qn, lay), to_rows(kn, lay), to_rows(v, lay)
    br = to_rows(beta.astype(F32), lay)
    gr = to_rows(g.astype(F32), lay) if g is not None else jnp.zeros(br.shape, F32)
    R = qr.shape[0]
    G2, later2 = gate_vectors(gr, R, HV)
    if resid is None:
        t0 = gate_free_inverse(kr, br, G_, dtype)
        h0t = None if h0 is None else jnp.swapaxes(h0.astype(F32), -1, -2)
        _, _, hs, vnT = fused_forward(qr, kr, vr, t0, G2, later2, br.T, table, h0t,
                                      scale=scale, group=G_, residuals=True)
    else:
        hs, vnT = resid
    # local factors in fp32 on chunks [NC, C, HV, ...]
    Gn = (G2 / LOG2E).T.reshape(R // C, C, HV)
    qe = jnp.repeat(_chunks(qr), G_, axis=2).astype(F32)
    ke = jnp.repeat(_chunks(kr), G_, axis=2).astype(F32)
    ve, be = _chunks(vr).astype(F32), _chunks(br)
    S = jnp.swapaxes(hs.astype(F32), -1, -2)                            # [NC, HV, K, V]
    vn = vnT.astype(F32).reshape(HV, V, R // C, C).transpose(2, 3, 0, 1)   # [NC, C, HV, V]
    cdt = None if LOCAL_MATMUL == "fp32" else dtype
    (_, w, _, _, _), vjp = jax.vjp(
        lambda q_, k_, v_, b_, G_l: _local(q_, k_, v_, b_, G_l, S, vn, scale=scale, cdt=cdt),
        qe, ke, ve, be, Gn)
    wneg = (-w).astype(dtype).reshape(R, HV, K).transpose(1, 0, 2)      # [HV, R, K]
    dor = to_rows(do.astype(dtype), lay)                                # [R, HV, V]
    doT = dor.transpose(1, 2, 0)
    dhtT = None if dht is None else jnp.swapaxes(dht.astype(F32), -1, -2)
    lamT, dvnT, dh0T = reverse_states(qr, kr, wneg, doT, G2, later2, table, dhtT,
                                      scale=scale, group=G_)
    lam = jnp.swapaxes(lamT, -1, -2)                                    # [NC, HV, K, V]
    dvn = dvnT.reshape(HV, V, R // C, C).transpose(2, 3, 0, 1)         # [NC, C, HV, V]
    mm = einsum if cdt is None else (lambda spec, x, y: _mm16(spec, x, y, cdt))
    dw = -mm("nihv,nhkv->nihk", dvn, S)
    dkd = mm("nihv,nhkv->nihk", vn, lam)
    dgam = jnp.sum(lam * S, axis=(-2, -1))
    dq, dk, dv, db, dG = vjp((_chunks(dor).astype(F32), dw, dvn, dkd, dgam))
    dg = jnp.cumsum(dG[:, ::-1], axis=1)[:, ::-1]                       # through the cumsum
    dq = dq.reshape(R, H, G_, K).sum(2)
    dk = dk.reshape(R, H, G_, K).sum(2)
    dq, dk = from_rows(dq, lay, B), from_rows(dk, lay, B)
    if l2:
        dq = jax.vjp(l2norm_fwd, q.astype(F32))[1](dq)[0]
        dk = jax.vjp(l2norm_fwd, k.astype(F32))[1](dk)[0]
    dv = from_rows(dv.reshape(R, HV, V), lay, B)
    db = from_rows(db.reshape(R, HV), lay, B)
    dg = None if g is None else from_rows(dg.reshape(R, HV), lay, B).astype(g.dtype)
    dh0 = None if h0 is None else jnp.swapaxes(dh0T, -1, -2).astype(h0.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg,
            db.astype(beta.dtype), dh0)

