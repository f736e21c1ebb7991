"""Chunk-parallel backward of the chunked (gated) delta rule as Pallas kernels (Triton lowering).

Forward of one chunk of BT tokens (see scalar_delta.py), one value head,
gc = chunk-local inclusive cumsum of g, Gamma = exp(gc), Dc[i, j] = exp(gc_i - gc_j) (j <= i),
A = strict_tril(beta_i (k_i . k_j) Dc), Tm = (I + A)^-1, W = Tm (beta Gamma K), U = Tm (beta V),
h = state at the chunk start, h' = state at its end:
    vn = U - W h
    o  = scale (Gamma * (Q h) + (tril(Q K^T) * Dc) vn)
    h' = exp(gc_L) h + (K * exp(gc_L - gc))^T vn
Backward, dh' = gradient of the chunk's end state:
  `chunk_dh` (sequential, reverse over the chunks of a sequence; one program per
  (sequence, value head, V block)):
    dvn = scale (tril(Q K^T) * Dc)^T do + (K * exp(gc_L - gc)) dh'
    dh  = exp(gc_L) dh' + scale (Gamma * Q)^T do - W^T dvn            (dh0 = dh of chunk 0)
  `chunk_grads` (parallel over chunks x value heads):
    P   = (do vn^T) * Dc (causal)
    dq  = scale (Gamma * (do h^T) + P K)          (dq_inter = the first term)
    dk  = scale P^T Q + exp(gc_L - gc) * (vn dh'^T)  (dk_state)   + the WY part below
    dW  = -dvn h^T,  dU = dvn
    dXw = Tm^T dW,   dXu = Tm^T dU   (Xw = beta Gamma K, Xu = beta V)
    dA  = -(dXw W^T + dXu U^T) on the strict lower triangle;  B = dA * Dc
    dk += beta Gamma dXw + (beta B) K + (beta B)^T K;   dv = beta dXu
    dbeta = rowsum(B * K K^T) + Gamma (k . dXw) + v . dXu
    dgc (gradient w.r.t. the chunk-local cumsum gc), from every place gc enters:
        q . dq_inter - k . dk_state + rowsum(M) - colsum(M) + rowsum(dA*A) - colsum(dA*A)
        + beta Gamma (k . dXw),  and at the last row  exp(gc_L) <h, dh'> + sum_j k_j . dk_state_j
      (M = scale (q k^T) * P strictly below the diagonal); dg = in-chunk reverse cumsum of dgc
      (a masked sum, never total - prefix). The k . dk_state pair is summed in closed form:
      dg_t gets sum_{s < t} k_s . dk_state_s (every term decayed by exp(g_t) or more), not
      -sum_{s >= t} + sum_all, whose O(1) term k_L . dk_state_L cancelled at every token (per-token
      gates in [-20, -10]: fp32 dg error 7.8e-3 -> 3.8e-7, test_gdn_chunk_dg_strong_gates_fp32).
  Every term scales with the decay it differentiates, so dg stays accurate under strong gates
  (the global identity dg_t = <h0, dh0> + sum_{s<t} (v.dv - q.dq) cancels O(1) terms and lost
  a factor 15 in bf16 with g down to -20).
Decay exponents are pairwise segment sums (sum_{j < s <= i} g_s, computed as one [BT, BT] dot
with a 0/1 matrix), never differences of large cumsums and never positive for g <= 0.
Tm is the forward's (scalar_wy_fwd.py stores it per chunk slot in q's dtype), not rebuilt here;
W is read as stored, exp(-gc_0) W (see scalar_wy_fwd.py), with exp(gc_0) applied in fp32.
Launch tiles (BT, BV, warps, stages) come from launch.delta_tiles(K, V, dtype).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..dispatch import pallas_interpret
from ..pallas_delta_layout import dot_precision, kdot, l2norm_fwd, triton_params
from ..pallas_triton import split_cumsum
from .scalar_wy_fwd import first_entry, masked_rows, store_rows

F32 = jnp.float32


def _chunk_gates(g_ref, st, end, BT, hv, first=False):
    """Returns gc [BT] (inclusive cumsum), g_last, suffix [BT] (= g_last - gc, as a direct
    sum) and Dc [BT, BT] = exp(sum_{j < s <= i} g_s) for j <= i else 0. Rows >= end: g = 0.
    first: also gc - gc_0 [BT] (the gap from the first token, column 0 of the segment sums)."""
    r = lax.broadcasted_iota(jnp.int32, (BT, BT), 0)
    c = lax.broadcasted_iota(jnp.int32, (BT, BT), 1)
    if g_ref is None:
        z = jnp.zeros((BT,), F32)
        out = (z, jnp.zeros((), F32), z, (r >= c).astype(F32))
        return out + (z,) if first else out
    gb = masked_rows(g_ref, st, end, BT, hv)
    g_last = jnp.sum(gb)
    gc, seg = split_cumsum(gb)      # seg[i, j] = sum_{j < s <= i} g_s, fp32-accurate gaps
    suffix = jnp.sum(jnp.where(c > r, gb[None, :], 0.0), axis=1)
    decay = jnp.where(r >= c, jnp.exp(jnp.where(r >= c, seg, 0.0)), 0.0)
    out = (gc, g_last, suffix, decay)
    return out + (jnp.sum(jnp.where(c == 0, seg, 0.0), axis=1),) if first else out


def _qk(ref, st, end, BT, h, l2norm):
    x = masked_rows(ref, st, end, BT, h)
    return l2norm_fwd(x).astype(ref.dtype) if l2norm else x


# ------------------------------------------------------------------- sequential dh kernel
def _dh_kernel(*refs, scale, G, BT, BV, has_g, has_dht, has_h0, l2norm, prec):
    it = iter(refs)
    cu_ref, first_ref, q_ref, k_ref, w_ref, do_ref = (next(it) for _ in range(6))
    g_ref = next(it) if has_g else None
    dht_ref = next(it) if has_dht else None
    dh_ref, dvn_ref = next(it), next(it)
    dh0_ref = next(it) if has_h0 else None

    n, hv, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h = hv // G
    vs = pl.ds(iv * BV, BV)
    bos, eos = cu_ref[n], cu_ref[n + 1]
    c0 = first_ref[n]
    nc = (eos - bos + BT - 1) // BT
    K = q_ref.shape[-1]
    dt = q_ref.dtype
    D = dht_ref[n, hv, :, vs].astype(F32) if has_dht else jnp.zeros((K, BV), F32)

    def body(j, D):
        i = nc - 1 - j
        st = bos + i * BT
        dh_ref[c0 + i, hv, :, vs] = D.astype(dh_ref.dtype)
        q = _qk(q_ref, st, eos, BT, h, l2norm)
        k = _qk(k_ref, st, eos, BT, h, l2norm)
        w = masked_rows(w_ref, st, eos, BT, hv)
        do = masked_rows(do_ref, st, eos, BT, hv, vs)
        gc, g_last, suffix, decay, rel0 = _chunk_gates(g_ref, st, eos, BT, hv, first=True)
        kq = (kdot(k, q.T, prec) * decay.T).astype(dt)             # [s, t]
        kd = (k.astype(F32) * jnp.exp(suffix)[:, None]).astype(dt)
        dvn = scale * kdot(kq, do, prec) + kdot(kd, D.astype(dt), prec)
        store_rows(dvn_ref, dvn, st, eos, hv, vs)
        # q exp(gc - gc_0) in q's dtype and exp(gc_0) in fp32 (W carries the same factor, see
        # scalar_wy_fwd.py): under strong gates exp(gc) q flushes to zero in fp16
        qd = (q.astype(F32) * jnp.exp(rel0)[:, None]).astype(dt)
        return (jnp.exp(g_last) * D
                + jnp.exp(first_entry(gc)) * (scale * kdot(qd.T, do, prec)
                                              - kdot(w.T, dvn.astype(dt), prec)))

    D = lax.fori_loop(0, nc, body, D)
    if has_h0:
        dh0_ref[n, hv, :, vs] = D


def chunk_dh(q, k, w, do, g, dht, cu, first, *, n_slots, has_h0, scale, l2norm, BT, tile):
    """q, k: [R, H, K]; w: [R, HV, K]; do: [R, HV, V] (one dtype); g: [R, HV] fp32 or None;
    dht: [N, HV, K, V] fp32 or None; cu, first: int32 [N+1].
    Returns dh [n_slots, HV, K, V] (q's dtype; gradient of each chunk's END state),
    dvn [R, HV, V] fp32 (gradient of v_new) and dh0 [N, HV, K, V] fp32 (or None).
    tile: (BV, num_warps, num_stages)."""
    R, H, K = q.shape
    HV, V = do.shape[1], do.shape[2]
    N = cu.shape[0] - 1
    interpret = pallas_interpret()
    BV = min(V, tile[0])
    kernel = functools.partial(_dh_kernel, scale=scale, G=HV // H, BT=BT, BV=BV,
                               has_g=g is not None, has_dht=dht is not None, has_h0=has_h0,
                               l2norm=l2norm, prec=dot_precision(interpret))
    ins = [x for x in (cu, first, q, k, w, do, g, dht) if x is not None]
    out_shape = [jax.ShapeDtypeStruct((n_slots, HV, K, V), q.dtype),
                 jax.ShapeDtypeStruct((R, HV, V), F32)]
    if has_h0:
        out_shape.append(jax.ShapeDtypeStruct((N, HV, K, V), F32))
    params = None if interpret else triton_params(tile[1], tile[2])
    outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(N, HV, V // BV),
                          interpret=interpret, name="chunk_gdn_bwd_dh",
                          compiler_params=params)(*ins)
    return outs[0], outs[1], (outs[2] if has_h0 else None)


# ------------------------------------------------------------ per-chunk gradient kernel
def _grads_kernel(*refs, scale, G, BT, BV, has_g, l2norm, prec):
    it = iter(refs)
    tab_ref, q_ref, k_ref, v_ref, b_ref = (next(it) for _ in range(5))
    g_ref = next(it) if has_g else None
    do_ref, w_ref, u_ref, vn_ref, h_ref, dh_ref, dvn_ref, tm_ref = (next(it) for _ in range(8))
    dq_ref, dk_ref, dv_ref, db_ref = (next(it) for _ in range(4))
    dg_ref = next(it) if has_g else None

    s, hv = pl.program_id(0), pl.program_id(1)
    h = hv // G
    start, end = tab_ref[s, 0], tab_ref[s, 1]
    K, V = q_ref.shape[-1], v_ref.shape[-1]
    dt = q_ref.dtype
    r = lax.broadcasted_iota(jnp.int32, (BT, BT), 0)
    c = lax.broadcasted_iota(jnp.int32, (BT, BT), 1)
    dd = lambda a, b: kdot(a.astype(dt), b.astype(dt), prec)

    @pl.when(end > start)
    def _():
        q = _qk(q_ref, start, end, BT, h, l2norm)
        k = _qk(k_ref, start, end, BT, h, l2norm)
        beta = masked_rows(b_ref, start, end, BT, hv)
        gc, g_last, suffix, decay = _chunk_gates(g_ref, start, end, BT, hv)
        gam = jnp.exp(gc)
        dq = jnp.zeros((BT, K), F32)
        dk = jnp.zeros((BT, K), F32)
        dw = jnp.zeros((BT, K), F32)
        P = jnp.zeros((BT, BT), F32)
        hdh = jnp.zeros((), F32)
        for iv in range(V // BV):
            vs = pl.ds(iv * BV, BV)
            do = masked_rows(do_ref, start, end, BT, hv, vs)
            vn = masked_rows(vn_ref, start, end, BT, hv, vs)
            dvn = masked_rows(dvn_ref, start, end, BT, hv, vs).astype(dt)
            hb = h_ref[s, hv, :, vs]
            dhb = dh_ref[s, hv, :, vs]
            dq = dq + kdot(do, hb.T, prec)
            dk = dk + kdot(vn, dhb.T, prec)
            dw = dw - kdot(dvn, hb.T, prec)
            P = P + kdot(do, vn.T, prec)
            if has_g:
                hdh = hdh + jnp.sum(hb.astype(F32) * dhb.astype(F32))
        strict = r > c
        q32, k32 = q.astype(F32), k.astype(F32)
        P = P * decay
        dq = scale * gam[:, None] * dq                  # inter-chunk part of dq
        dk = jnp.exp(suffix)[:, None] * dk              # state-update part of dk
        if has_g:   # chunk-local gate gradient dgc (w.r.t. gc), terms that scale with decay
            dgc = jnp.sum(q32 * dq, axis=1)
            M = jnp.where(strict, scale * P * kdot(q, k.T, prec), 0.0)
            dgc = dgc + jnp.sum(M, axis=1) - jnp.sum(M, axis=0)
            # the k . dk_state pair in closed form (see the module docstring)
            kdk = jnp.sum(k32 * dk, axis=1)
            dg_state = jnp.sum(jnp.where(c < r, kdk[None, :], 0.0), axis=1) \
                + jnp.exp(g_last) * hdh
        P = P.astype(dt)
        dq = dq + scale * kdot(P, k, prec)
        dk = dk + scale * kdot(P.T, q, prec)
        # WY backward
        kk = kdot(k, k.T, prec)
        tm = tm_ref[s, hv]
        dxw = kdot(tm.T, dw.astype(dt), prec)
        w = masked_rows(w_ref, start, end, BT, hv)
        dA = -jnp.exp(first_entry(gc)) * dd(dxw, w.T)   # W is stored as exp(-gc_0) W
        db = jnp.zeros((BT,), F32)
        for iv in range(V // BV):
            vs = pl.ds(iv * BV, BV)
            dvn = masked_rows(dvn_ref, start, end, BT, hv, vs).astype(dt)
            u = masked_rows(u_ref, start, end, BT, hv, vs)
            v = masked_rows(v_ref, start, end, BT, hv, vs).astype(F32)
            dxu = kdot(tm.T, dvn, prec)
            dA = dA - dd(dxu, u.T)
            store_rows(dv_ref, beta[:, None] * dxu, start, end, hv, vs)
            db = db + jnp.sum(v * dxu, axis=1)
        B = jnp.where(strict, dA * decay, 0.0)
        wk = gam * jnp.sum(k32 * dxw, axis=1)
        db = db + jnp.sum(B * kk, axis=1) + wk
        Bb = B * beta[:, None]
        dk = dk + (beta * gam)[:, None] * dxw + dd(Bb, k) + dd(Bb.T, k)
        store_rows(dq_ref, dq, start, end, hv)
        store_rows(dk_ref, dk, start, end, hv)
        store_rows(db_ref, db, start, end, hv)
        if has_g:
            Ad = Bb * kk                                # dA * A
            dgc = dgc + beta * wk + jnp.sum(Ad, axis=1) - jnp.sum(Ad, axis=0)
            dg = jnp.sum(jnp.where(c >= r, dgc[None, :], 0.0), axis=1) + dg_state
            store_rows(dg_ref, dg, start, end, hv)


def chunk_grads(q, k, v, g, beta, do, w, u, vn, h, dh, dvn, tm, table, *, scale, l2norm, BT,
                tile, dqk_dtype=F32):
    """Per chunk slot (table int32 [NC, 2]) and value head. q, k: [R, H, K]; v, do, u, vn:
    [R, HV, V]; w: [R, HV, K] (one dtype); g (or None), beta: [R, HV] fp32; h, dh:
    [NC, HV, K, V] chunk start states / end-state gradients (q's dtype); dvn [R, HV, V] fp32;
    tm [NC, HV, BT, BT] the forward's (I + A)^-1 (q's dtype); tile: (BV, num_warps).
    Returns dq, dk [R, HV, K] in dqk_dtype (fp32 accumulation, rounded once at the store; per
    value head, w.r.t. the normalised q/k when l2norm),
    dv [R, HV, V] (v's dtype), dbeta [R, HV] fp32 and dg [R, HV] fp32 (or None)."""
    R, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    interpret = pallas_interpret()
    BV = min(V, tile[0])
    kernel = functools.partial(_grads_kernel, scale=scale, G=HV // H, BT=BT, BV=BV,
                               has_g=g is not None, l2norm=l2norm,
                               prec=dot_precision(interpret))
    ins = [x for x in (table, q, k, v, beta, g, do, w, u, vn, h, dh, dvn, tm) if x is not None]
    out_shape = [jax.ShapeDtypeStruct((R, HV, K), dqk_dtype),
                 jax.ShapeDtypeStruct((R, HV, K), dqk_dtype),
                 jax.ShapeDtypeStruct((R, HV, V), v.dtype), jax.ShapeDtypeStruct((R, HV), F32)]
    if g is not None:
        out_shape.append(jax.ShapeDtypeStruct((R, HV), F32))
    params = None if interpret else triton_params(tile[1], 1)
    outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(table.shape[0], HV),
                          interpret=interpret, name="chunk_gdn_bwd_grads",
                          compiler_params=params)(*ins)
    return tuple(outs) + ((None,) if g is None else ())
