"""Mosaic GPU (sm_90) per-chunk gradients of the chunked gated delta rule: one CTA per
(chunk, value head; one warpgroup here, two in mosaic_bwd_grads_ws.py, the default),
chunk-parallel, all of K and V (K, V <= 128).

Per chunk (C = 64 rows; log2 units: G the chunk-local cumsum, Gamma = exp2(G),
D_ij = exp2(G_i - G_j) for j <= i, Tg = T0 * D the gated inverse, Ag = Tg diag(beta)), with
the forward's residuals S^T (state entering the chunk) and v_new, and the reverse pass'
L^T (cotangent of the state leaving the chunk) and dv_new:
    W = Ag (Gamma k),  U = Ag v                           (recomputed here; W as
                                      W' = exp2(-G_0) W, the factor applied in fp32)
    P    = (do v_new^T) * D                     [C, C]
    dq   = scale (Gamma (do S^T) + P k)
    dk   = exp2(G_last - G) (v_new L) + scale P^T q + beta Gamma dXw + (beta B) k + (beta B)^T k
    dXw  = Tg^T (-dv_new S^T),  dXu = Tg^T dv_new,   dv = beta dXu
    dA   = -(dXw W^T + dXu U^T),  B = strict_lower(dA * D)
    dbeta = v . dXu + Gamma (k . dXw) + rowsum(B * k k^T)
Gate gradient (w.r.t. the chunk-local cumsum, natural units: each exp2 term differentiates to
itself), the closed form of engine/scalar_delta_bwd.py: per row
    r1 = q . dq_inter + rowsum(M) - colsum(M) + beta Gamma (k . dXw) + rowsum(Ad) - colsum(Ad)
         (+ exp2(G_last) <S, L> on the chunk's last row),
    r2 = k . dk_state,
with M = strict(scale P * q k^T), Ad = (beta B) * k k^T; dg = in-chunk reverse cumsum of r1
plus the exclusive in-chunk cumsum of r2 (mosaic_bwd.py), never total minus prefix. Column
sums are row sums of the transposed tiles, formed by their own products (fp32, no rounding
of M or Ad). Every product: 16-bit operands, fp32 accumulation; dq, dk, dv leave in q's dtype
(per value head; the GQA group sum is done by the caller).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common.mosaic.tiles import (COLS, F32, ROWS, WGMMA, build, causal_decay, cols_of, iota,
                                   iota_vec, load, matmul, matmuls, rows_of, smem_tile, union)
from .mosaic_bwd_kernel import chain
from .mosaic_fwd_kernel import C

# Warpgroups per CTA: 2 (mosaic_bwd_grads_ws.py: the dq side and the dk / WY side of the chunk
# in parallel; H100, RESULTS.md run 16 call 1: GDN training step 1.139 ms vs 1.353 with 1, delta
# rule 1.003 vs 1.199; ptxas 16 B spilled vs 792 B; GPU parity 0 failed) or 1 (this file's kernel)
WARPGROUPS = 2
# ex2.approx for the decays of the gradient kernel (~2 ulp; with the reverse pass's the GDN
# training step 0.978 -> 0.905 ms on the H100, RESULTS.md run 20 call 9; GPU parity 0 failed)
APPROX_MATH = True

MAX_HEAD = 128   # K and V: the chunk's tiles fit shared memory (208 KB at K = V = 128)


def mm(*ops, pad=0):
    """Independent products ((a, b, shape, init, ta, tb) as for tiles.matmuls)
    issued together, one wait (H100: the same time as one wait per product, RESULTS.md run 15);
    the result tuple padded with None to `pad` entries."""
    return tuple(matmuls(*ops)) + (None,) * (pad - len(ops))


def check_heads(K: int, V: int) -> None:
    if max(K, V) > MAX_HEAD:
        raise ValueError(f"mosaic chunk_grads: K={K}, V={V}; takes K, V <= {MAX_HEAD}")


def scratch_of(K: int, V: int, dt, with_bb: bool = False, **extra) -> dict:
    """The SMEM buffers of the gradient kernels (`extra`: a variant's own). with_bb: dq_o is
    a union of the dq staging tile and a [C, C] tile for beta B (once dq is stored)."""
    sq = (C, C)
    vec = lambda: plgpu.SMEM((C,), F32)
    return dict(
        q_s=smem_tile((C, K), dt), k_s=smem_tile((C, K), dt),
        v_s=smem_tile((C, V), dt), do_s=smem_tile((C, V), dt),
        t_s=smem_tile(sq, dt), tg_s=smem_tile(sq, dt), ag_s=smem_tile(sq, dt),
        agk_s=smem_tile(sq, dt),
        # the states until dw is formed, then the WY cotangents (dw_s holds W once dXw is out)
        st=union((smem_tile((V, K), dt), smem_tile((V, K), dt)),
                 (smem_tile((C, K), dt), smem_tile((C, K), dt), smem_tile((C, V), dt),
                  smem_tile((C, V), dt))),
        # v_new and its cotangent until dXu is formed, then the dv / dk staging
        vn=union((smem_tile((V, C), dt), smem_tile((V, C), dt)),
                 (smem_tile((C, V), dt), smem_tile((C, K), dt))),
        dq_o=(union(smem_tile((C, K), dt), smem_tile(sq, dt)) if with_bb
              else smem_tile((C, K), dt)),
        g_r=vec(), g_c=vec(), s_r=vec(), b_r=vec(), b_c=vec(),
        db_o=vec(), r1_o=vec(), r2_o=vec(),
        bar=plgpu.Barrier(num_arrivals=14, num_barriers=1),
        **extra)


def out_type_of(R: int, HV: int, K: int, V: int, dt, gated: bool) -> list:
    out = [jax.ShapeDtypeStruct((R, HV, K), dt), jax.ShapeDtypeStruct((R, HV, K), dt),
           jax.ShapeDtypeStruct((R, HV, V), dt), jax.ShapeDtypeStruct((HV, R), F32)]
    return out + ([jax.ShapeDtypeStruct((HV, R), F32)] * 2 if gated else [])


def issue_loads(refs, bufs, c, hv, h):
    """TMA copies of chunk c's inputs (refs: the kernel's 12 input refs) into the scratch
    buffers, all arriving on bufs['bar'][0]."""
    (q_ref, k_ref, v_ref, do_ref, t_ref, hs_ref, dh_ref, vn_ref, dvn_ref, gc_ref, gs_ref,
     b_ref) = refs
    b = bufs
    (h_s, dh_s), _ = b["st"]
    (vn_s, dvn_s), _ = b["vn"]
    rows = pl.ds(c * C, C)
    for src, dst in ((q_ref.at[rows, h], b["q_s"]), (k_ref.at[rows, h], b["k_s"]),
                     (v_ref.at[rows, hv], b["v_s"]), (do_ref.at[rows, hv], b["do_s"]),
                     (t_ref.at[hv, rows], b["t_s"]), (hs_ref.at[c, hv], h_s),
                     (dh_ref.at[c, hv], dh_s), (vn_ref.at[hv, :, rows], vn_s),
                     (dvn_ref.at[hv, :, rows], dvn_s), (gc_ref.at[hv, rows], b["g_r"]),
                     (gc_ref.at[hv, rows], b["g_c"]), (gs_ref.at[hv, rows], b["s_r"]),
                     (b_ref.at[hv, rows], b["b_r"]), (b_ref.at[hv, rows], b["b_c"])):
        # G and beta twice: one buffer per register layout they are read in (one buffer
        # read as rows and as columns fails Mosaic's layout inference on jax 0.11.2)
        plgpu.copy_gmem_to_smem(src, dst, b["bar"].at[0])


def decay_fns(g_r, g_c):
    """dec(transposed) -> D (D^T) and strict(transposed) -> i > j (i < j), formed where used
    from SMEM (not kept live across the kernel: registers)."""
    sq = (C, C)

    def dec(transposed=False):
        return causal_decay(load(g_r, ROWS), load(g_c, COLS), sq, transposed=transposed)

    def strict(transposed=False):
        r, cc = iota(sq, 0), iota(sq, 1)
        return cc > r if transposed else r > cc
    return dec, strict


def dq_stage(q_s, k_s, do_s, vn_s, h_s, dq_o, dq_out, dec, strict, gam, *, scale, gated):
    """dq = scale (Gamma (do S^T) + P k), staged in dq_o and stored (TMA) to dq_out; returns
    the gate rows' q-side part q . dq_inter + rowsum(M) (None unless gated)."""
    T, F = True, False
    sq, K, dt = (C, C), q_s.shape[-1], q_s.dtype
    p, dq, qk = mm((do_s, vn_s, sq, None, F, F), (do_s, h_s, (C, K), None, F, F),
                   *([(q_s, k_s, sq, None, F, T)] if gated else []), pad=3)
    p = p * dec()
    dq = dq * rows_of(gam * scale, (C, K))                               # dq_inter
    r1 = None
    if gated:
        m = jnp.where(strict(), p * qk * scale, 0.0)
        r1 = jnp.sum(load(q_s, WGMMA).astype(F32) * dq, axis=1) + jnp.sum(m, axis=1)
    dq = matmul((p * scale).astype(dt), k_s, (C, K), init=dq)
    dq_o[...] = dq.astype(dt)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_o, dq_out)
    return r1


def inverse_stage(dw, t_s, tg_s, ag_s, agk_s, dw_s, b_c, g_c, g_first, dec):
    """-dw into dw_s (the states' SMEM), and Tg, Ag = Tg diag(beta), Ag Gamma' (Gamma
    relative to the first row: no fp16 underflow of strong gates) into SMEM, fenced."""
    sq, dt = (C, C), t_s.dtype
    dw_s[...] = (-dw).astype(dt)
    tg = load(t_s, WGMMA).astype(F32) * dec()                            # Tg
    tg_s[...] = tg.astype(dt)
    beta_c = load(b_c, COLS)
    ag_s[...] = (tg * cols_of(beta_c, sq)).astype(dt)
    agk_s[...] = (tg * cols_of(beta_c * jnp.exp2(load(g_c, COLS) - g_first), sq)).astype(dt)
    plgpu.commit_smem()


def store_last(bufs, out_refs, rows, hv, dk, db, r1, r2, state):
    """Stage and store (TMA, waited) dk (q's dtype), dbeta and, when r1 is not None, the gate
    rows, r1 with `state` (exp2(G_last) <S, L>) added on the chunk's last row."""
    dk_o, db_o, r1_o, r2_o = bufs
    dk_ref, db_ref, r1_ref, r2_ref = out_refs
    dk_o[...] = dk
    db_o[...] = db
    if r1 is not None:
        r1_o[...] = r1 + jnp.where(iota_vec(C, ROWS) == C - 1, state, 0.0)
        r2_o[...] = r2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dk_o, dk_ref.at[rows, hv])
    plgpu.copy_smem_to_gmem(db_o, db_ref.at[hv, rows])
    if r1 is not None:
        plgpu.copy_smem_to_gmem(r1_o, r1_ref.at[hv, rows])
        plgpu.copy_smem_to_gmem(r2_o, r2_ref.at[hv, rows])
    plgpu.wait_smem_to_gmem(0)


def chunk_grads(q, k, v, do, t0, hs, dh, vnT, dvnT, gcum, gsuf, beta, *, scale: float,
                group: int, gated: bool):
    """q, k: [R, H, K]; v, do: [R, HV, V]; t0: [HV, R, C] (gate-free inverse per chunk);
    hs, dh: [R // C, HV, V, K] (transposed state entering / cotangent of the state leaving each
    chunk); vnT, dvnT: [HV, V, R] (v_new and its cotangent, transposed), all in one 16-bit
    dtype; gcum, gsuf, beta: [HV, R] fp32 (G and G_last - G in log2 units, beta).
    Returns dq, dk [R, HV, K], dv [R, HV, V] (q's dtype, per value head), dbeta [HV, R] fp32
    and, when gated, r1, r2 [HV, R] fp32 (see the module docstring)."""
    R, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    check_heads(K, V)
    if WARPGROUPS == 2:
        from .mosaic_bwd_grads_ws import chunk_grads_ws
        return chunk_grads_ws(q, k, v, do, t0, hs, dh, vnT, dvnT, gcum, gsuf, beta,
                              scale=scale, group=group, gated=gated)
    dt = q.dtype
    sq = (C, C)
    scratch = scratch_of(K, V, dt)
    out_type = out_type_of(R, HV, K, V, dt, gated)

    def body(*refs, q_s, k_s, v_s, do_s, t_s, tg_s, ag_s, agk_s, st, vn, dq_o, g_r, g_c,
             s_r, b_r, b_c, db_o, r1_o, r2_o, bar):
        dq_ref, dk_ref, dv_ref, db_ref = refs[12:16]
        r1_ref, r2_ref = refs[16:18] if gated else (None, None)
        (h_s, dh_s), (dw_s, dxw_s, dxu_s, u_s) = st
        (vn_s, dvn_s), (dv_o, dk_o) = vn
        c, hv = lax.axis_index("c"), lax.axis_index("hv")
        rows = pl.ds(c * C, C)
        issue_loads(refs[:12], dict(q_s=q_s, k_s=k_s, v_s=v_s, do_s=do_s, t_s=t_s, st=st,
                                    vn=vn, g_r=g_r, g_c=g_c, s_r=s_r, b_r=b_r, b_c=b_c,
                                    bar=bar), c, hv, lax.div(hv, group))
        plgpu.barrier_wait(bar.at[0])

        g_row = load(g_r, ROWS)
        beta_r = load(b_r, ROWS)
        g_first, g_last = g_r[0], g_r[C - 1]
        gam = jnp.exp2(g_row)                                           # Gamma (rows)

        dec, strict = decay_fns(g_r, g_c)

        # <S, L> before the state tiles are reused (in 64-row slices: registers)
        hdh = jnp.zeros((), F32)
        r1 = r2 = None                   # the gate rows (gated only)
        if gated:
            for i in range(V // 64):
                sl = pl.ds(i * 64, 64)
                hdh = hdh + jnp.sum(jnp.sum(load(h_s.at[sl], WGMMA).astype(F32)
                                            * load(dh_s.at[sl], WGMMA).astype(F32), axis=1))

        # dq; products of one stage are issued together
        T, F = True, False
        r1 = dq_stage(q_s, k_s, do_s, vn_s, h_s, dq_o, dq_ref.at[rows, hv], dec, strict, gam,
                      scale=scale, gated=gated)

        # dk: the state part exp2(G_last - G) (v_new L) and scale P^T q; -dw = dv_new S^T
        p_t, dk, dw, kq = mm((vn_s, do_s, sq, None, T, T), (vn_s, dh_s, (C, K), None, T, F),
                             (dvn_s, h_s, (C, K), None, T, F),
                             *([(k_s, q_s, sq, None, F, T)] if gated else []), pad=4)
        p_t = p_t * dec(True)                                            # P^T
        dk = dk * rows_of(jnp.exp2(load(s_r, ROWS)), (C, K))
        if gated:
            m_t = jnp.where(strict(True), p_t * kq * scale, 0.0)
            r1 = r1 - jnp.sum(m_t, axis=1)
            r2 = jnp.sum(load(k_s, WGMMA).astype(F32) * dk, axis=1)
        # the states are read: their SMEM now holds the WY cotangents
        inverse_stage(dw, t_s, tg_s, ag_s, agk_s, dw_s, b_c, g_c, g_first, dec)
        dk = matmul((p_t * scale).astype(dt), q_s, (C, K), init=dk)

        # dXu = Tg^T dv_new, dv = beta dXu; dXw = Tg^T dw
        dxu, dxw = mm((tg_s, dvn_s, (C, V), None, T, T), (tg_s, dw_s, (C, K), None, T, F))
        db = jnp.sum(load(v_s, WGMMA).astype(F32) * dxu, axis=1)
        dxu_s[...] = dxu.astype(dt)
        dv_o[...] = (dxu * rows_of(beta_r, (C, V))).astype(dt)   # v_new is read: its SMEM
        wk = gam * jnp.sum(load(k_s, WGMMA).astype(F32) * dxw, axis=1)
        db = db + wk
        if gated:
            r1 = r1 + beta_r * wk
        dk = dk + dxw * rows_of(beta_r * gam, (C, K))
        dxw_s[...] = dxw.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dv_o, dv_ref.at[rows, hv])
        # W' and U of the forward (W' into dw_s, which dXw has read)
        w, u = mm((agk_s, k_s, (C, K), None, F, F), (ag_s, v_s, (C, V), None, F, F))
        dw_s[...] = w.astype(dt)
        u_s[...] = u.astype(dt)
        plgpu.commit_smem()

        # dA = -(exp2(G_0) dXw W'^T + dXu U^T) and its transpose (own products: fp32 column
        # sums)
        x, x_t, kk = mm((dxw_s, dw_s, sq, None, F, T), (dw_s, dxw_s, sq, None, F, T),
                        (k_s, k_s, sq, None, F, T))
        e0 = jnp.exp2(g_first)
        da, da_t = mm((dxu_s, u_s, sq, x * e0, F, T), (u_s, dxu_s, sq, x_t * e0, F, T))
        bm = jnp.where(strict(), -da * dec(), 0.0)
        db = db + jnp.sum(bm * kk, axis=1)
        bb = bm * rows_of(beta_r, sq)                                   # beta B
        bb_t = jnp.where(strict(True), -da_t * dec(True), 0.0) * cols_of(load(b_c, COLS), sq)
        if gated:
            r1 = r1 + jnp.sum(bb * kk, axis=1) - jnp.sum(bb_t * kk, axis=1)
        dk = chain(dk, (bb.astype(dt), k_s), (bb_t.astype(dt), k_s), shape=(C, K))
        store_last((dk_o, db_o, r1_o, r2_o), (dk_ref, db_ref, r1_ref, r2_ref), rows, hv,
                   dk.astype(dt), db, r1, r2, jnp.exp2(g_last) * hdh)

    outs = build(body, name="gdn_bwd_grads", out_type=out_type, scratch=scratch,
                 grid=(R // C, HV), grid_names=("c", "hv"))(
        q, k, v, do, t0, hs, dh, vnT, dvnT, gcum, gsuf, beta)
    return tuple(outs) if gated else (*outs, None, None)
