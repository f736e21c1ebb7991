"""Inter-chunk state pass of the per-key-gated delta rule (Pallas, Triton lowering), forward
and backward: the mirror of fla_torch/ops/common/engine/delta_state.py.

One program per (sequence, head, V block) walks the chunks of its sequence with the whole K
of the state tile [Kp, BV] fp32. Everything that does not depend on the carried state comes
precomputed, chunk-parallel, from delta_prep.py: with b the in-chunk cumsum of the log-decay,
b_0 its first row and `last` its value at the chunk's end, kg = k exp(last - b),
e0 = exp(b_0), el = exp(last) (delta_prep_fwd), qd = q exp(b - b_0) and
A_do = scale Aqk^T do (delta_prep_bwd). With w, u from wy.py (w relative to the chunk's
first row), the chunk loops only do:
    forward:  h[slot] = S (the state before the chunk, in pb.state_dtype)
              vn = u - w (diag(e0) S)                        (stored in u's dtype)
              S <- diag(el) S + kg^T vn;   final state = S (fp32)
    backward: dh[slot] = dS (the gradient of the state after the chunk, pb.state_dtype)
              dvn = A_do + kg dS                             (stored fp32)
              dS <- diag(el) dS + diag(e0) (scale qd^T do - w^T dvn);
              dh0 = dS before the first chunk
              (w^T dvn with the fp32 dvn split in bf16 hi + lo for 16-bit w: ptr.split_matmul)
Shapes: kg, qd, w [B, T, H, K]; u, do [B, T, H, V] (one dtype); e0, el [slots, H, Kp] fp32;
A_do [B, T, H, V] fp32; h0 / dht [N, H, K, V] fp32; h / dh [slots, H, Kp, Vp].
Launch: V block `bv` and `num_warps` per call (None: the module knobs BV / NUM_WARPS, None:
the heuristic of _launch), for GPU sweeps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from . import specs
from . import varlen as vl
from .launch import Launch, Problem, call

F32 = jnp.float32
# sweep knobs (None: the heuristic); a call's bv / num_warps arguments take precedence
BV = None
NUM_WARPS = None


def _launch(pb, dtype, bv=None, num_warps=None, backward=False):
    """The whole K per program; default V block keeps the [Kp, BV] fp32 state tile <= 64 KiB;
    4 warps forward, 8 backward (H100 bf16 B4 T4096 H16 K=V=128, session 9: backward 1.32 ->
    0.50 ms at bv 64, 1.09 -> 0.73 at bv 32; forward 8 warps no faster)."""
    bv = bv or BV or min(pb.Vp, 64 if pb.Kp <= 128 and jnp.dtype(dtype).itemsize < 4 else 32)
    bv = min(pb.Vp, bv)
    return bv, Launch(None, bv, num_warps or NUM_WARPS or (8 if backward else 4),
                      1 if jnp.dtype(dtype).itemsize == 4 else 2)


def _program(refs, pb, bv):
    n, j = pl.program_id(0), pl.program_id(2)
    bos, L = vl.sequence_bounds(refs, pb.varlen, pb.T, n)
    slot0 = vl.first_slot(pb.varlen, pb.T, pb.bt, n, bos)
    return j * bv, bos, L, slot0, (L + pb.bt - 1) // pb.bt


def _fwd_kernel(refs, pb, bv):
    bt, prec = pb.bt, pb.precision
    c0, bos, L, slot0, nt = _program(refs, pb, bv)
    if pb.has_h0:
        S0 = ptr.load_tile(refs["h0"], pb.K, pb.V, 0, c0)
    else:
        S0 = jnp.zeros((pb.Kp, bv), F32)

    def body(c, S):
        start, nv = bos + c * bt, L - c * bt
        refs["h"][slot0 + c, :, :] = S.astype(refs["h"].dtype)
        w = ptr.load_rows(refs["w"], start, bt, nv, pb.K)
        dt = w.dtype
        u = ptr.load_rows(refs["u"], start, bt, nv, pb.V, c0)
        kg = ptr.load_rows(refs["kg"], start, bt, nv, pb.K)
        e0, el = refs["e0"][slot0 + c, :], refs["el"][slot0 + c, :]
        vn = u.astype(F32) - ptr.matmul(w, (S * e0[:, None]).astype(dt), (1, 0), prec)
        ptr.store_rows(refs["vn"], start, nv, pb.V, vn, c0)
        return S * el[:, None] + ptr.matmul(kg, vn.astype(dt), (0, 0), prec)

    S = lax.fori_loop(0, nt, body, S0)
    ptr.store_tile(refs["ht"], S, pb.K, pb.V, 0, c0)


def _specs(pb, bv):
    """(rows spec of a K-wide input, of a V-block input, state tile spec, chunk-states spec)."""
    return (specs.seq_rows(pb, pb.Kp, specs.zero), specs.seq_rows(pb, bv, specs.same),
            specs.state(pb.Kp, bv, specs.zero, specs.same),
            specs.chunk_states(pb, pb.Kp, bv, specs.zero, specs.same))


def delta_state_fwd(pb: Problem, kg, w, u, e0, el, h0, cu, bv=None, num_warps=None):
    """kg, w [B, T, H, K], u [B, T, H, V] (one dtype), e0, el [slots, H, Kp] fp32
    (delta_prep_fwd), h0 None or [N, H, K, V] fp32, cu None or int32 [N+1]; bv / num_warps:
    launch overrides. Returns (h [slots, H, Kp, Vp] in pb.state_dtype, vn [B, T, H, V] in
    u's dtype, final state [N, H, K, V] fp32)."""
    bv, launch = _launch(pb, u.dtype, bv, num_warps)
    krow, vrow, st, chunk = _specs(pb, bv)
    vec = specs.chunk_vecs(pb, pb.Kp)
    ins = [("kg", kg, krow), ("w", w, krow), ("u", u, vrow), ("e0", e0, vec), ("el", el, vec)]
    if pb.varlen:
        ins.append(("cu", cu, specs.full(cu)))
    if pb.has_h0:
        ins.append(("h0", h0, st))
    outs = [("h", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp, pb.Vp), pb.state_dtype),
             chunk),
            ("vn", jax.ShapeDtypeStruct(u.shape, u.dtype), vrow),
            ("ht", jax.ShapeDtypeStruct((pb.N, pb.H, pb.K, pb.V), F32), st)]
    r = call(lambda refs: _fwd_kernel(refs, pb, bv), (pb.N, pb.H, pl.cdiv(pb.Vp, bv)), ins,
             outs, launch, "kda_state_fwd")
    return r["h"], r["vn"], r["ht"]


def _bwd_kernel(refs, pb, bv):
    bt, prec = pb.bt, pb.precision
    c0, bos, L, slot0, nt = _program(refs, pb, bv)
    dS0 = ptr.load_tile(refs["dht"], pb.K, pb.V, 0, c0)

    def body(i, dS):
        c = nt - 1 - i
        start, nv = bos + c * bt, L - c * bt
        refs["dh"][slot0 + c, :, :] = dS.astype(refs["dh"].dtype)
        qd = ptr.load_rows(refs["qd"], start, bt, nv, pb.K)
        dt = qd.dtype
        kg = ptr.load_rows(refs["kg"], start, bt, nv, pb.K)
        w = ptr.load_rows(refs["w"], start, bt, nv, pb.K)
        do = ptr.load_rows(refs["do"], start, bt, nv, pb.V, c0)
        ado = ptr.load_rows(refs["Ado"], start, bt, nv, pb.V, c0)
        e0, el = refs["e0"][slot0 + c, :], refs["el"][slot0 + c, :]
        dvn = ado + ptr.matmul(kg, dS.astype(dt), (1, 0), prec)
        ptr.store_rows(refs["dvn"], start, nv, pb.V, dvn, c0)
        upd = pb.scale * ptr.matmul(qd, do, (0, 0), prec) \
            - ptr.split_matmul(w, dvn, (0, 0), prec)
        return dS * el[:, None] + e0[:, None] * upd

    dS = lax.fori_loop(0, nt, body, dS0)
    if pb.has_h0:
        ptr.store_tile(refs["dh0"], dS, pb.K, pb.V, 0, c0)


def delta_state_bwd(pb: Problem, qd, kg, w, e0, el, Ado, do, dht, cu, bv=None,
                    num_warps=None):
    """qd, kg, w [B, T, H, K], do [B, T, H, V] (one dtype), e0, el [slots, H, Kp] fp32
    (delta_prep_fwd), Ado [B, T, H, V] fp32 (delta_prep_bwd, with qd), dht [N, H, K, V]
    fp32; bv / num_warps: launch overrides. Returns (dh [slots, H, Kp, Vp] in
    pb.state_dtype, dvn [B, T, H, V] fp32, dh0 [N, H, K, V] fp32 or None without
    pb.has_h0)."""
    bv, launch = _launch(pb, do.dtype, bv, num_warps, backward=True)
    krow, vrow, st, chunk = _specs(pb, bv)
    vec = specs.chunk_vecs(pb, pb.Kp)
    ins = [("qd", qd, krow), ("kg", kg, krow), ("w", w, krow), ("do", do, vrow),
           ("Ado", Ado, vrow), ("e0", e0, vec), ("el", el, vec), ("dht", dht, st)]
    if pb.varlen:
        ins.append(("cu", cu, specs.full(cu)))
    outs = [("dh", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp, pb.Vp), pb.state_dtype),
             chunk),
            ("dvn", jax.ShapeDtypeStruct(do.shape, F32), vrow)]
    if pb.has_h0:
        outs.append(("dh0", jax.ShapeDtypeStruct((pb.N, pb.H, pb.K, pb.V), F32), st))
    r = call(lambda refs: _bwd_kernel(refs, pb, bv), (pb.N, pb.H, pl.cdiv(pb.Vp, bv)), ins,
             outs, launch, "kda_state_bwd")
    return r["dh"], r["dvn"], r.get("dh0")
