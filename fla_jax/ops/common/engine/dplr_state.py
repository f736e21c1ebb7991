"""Inter-chunk state pass of a DPLR recurrence (Pallas, Triton lowering), forward and
backward (jax.custom_vjp): the mirror of fla_torch/ops/common/engine/dplr_state.py.

Slot layout [S, H, BT, D] fp32 (dplr.py). Per sequence n, its chunks are the slots
first[n] .. first[n] + count[n] - 1. One program per (sequence, head, V block) carries the
state S [K, BV] fp32 (the whole K) through them:
    S_in[slot] = S;   U = u + w S;   S <- diag(tot) S + b_out^T U + k_out^T v
(u, w: the chunk's solved WY terms; b_out, k_out, tot from dplr_scores.py). Backward, dS the
gradient of the state after the chunk (dht at the end):
    dU = dU_ext + b_out dS;   du = dU;   dv = k_out dS;   dw = dU S_in^T;
    db_out = U dS^T;   dk_out = v dS^T;   dtot = rowsum(S_in * dS);
    dS <- diag(tot) dS + w^T dU + dS_in_ext[slot];   dh0 = dS before the first chunk.
dw, db_out, dk_out, dtot are partial over V blocks (summed here). Slots of no chunk (varlen
gaps) are never visited; `slot_valid` masks them to zero.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr

F32 = jnp.float32


def _bv(Kp, Vp):
    return min(Vp, 32 if Kp > 128 else 64)


def slot_valid(first, count, S):
    """bool [S]: the slot holds a chunk of some sequence (first, count int32 [N])."""
    hits = jnp.zeros((S + 1,), jnp.int32).at[first].add(1, mode="drop")
    hits = hits.at[first + count].add(-1, mode="drop")
    return jnp.cumsum(hits)[:S] > 0


def _mask(x, valid):
    return jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)


def _specs(S, BT, Kp, bv):
    """BlockSpecs on grid (N, H, NV): every slot of one head (K whole, V block j)."""
    return {
        "kvec": pl.BlockSpec((S, None, BT, Kp), lambda n, h, j: (0, h, 0, 0)),
        "vvec": pl.BlockSpec((S, None, BT, bv), lambda n, h, j: (0, h, 0, j)),
        "tot": pl.BlockSpec((S, None, Kp), lambda n, h, j: (0, h, 0)),
        "states": pl.BlockSpec((S, None, Kp, bv), lambda n, h, j: (0, h, 0, j)),
        "state": pl.BlockSpec((None, None, Kp, bv), lambda n, h, j: (n, h, 0, j)),
        "kpart": pl.BlockSpec((None, S, None, BT, Kp), lambda n, h, j: (j, 0, h, 0, 0)),
        "tpart": pl.BlockSpec((None, S, None, Kp), lambda n, h, j: (j, 0, h, 0)),
    }


def _full(x):
    return pl.BlockSpec(x.shape, lambda n, h, j: (0,) * x.ndim)


def _call(kernel, ins, outs, grid, name):
    names = [n for n, _, _ in ins] + [n for n, _, _ in outs]

    def body(*refs):
        kernel(dict(zip(names, refs)))

    res = pl.pallas_call(body, grid=grid, in_specs=[s for _, _, s in ins],
                         out_specs=[s for _, _, s in outs],
                         out_shape=[a for _, a, _ in outs],
                         compiler_params=ptr.compiler_params(4, 1),
                         interpret=ptr.interpret(), name=name)(*[a for _, a, _ in ins])
    return dict(zip([n for n, _, _ in outs], res))


def _fwd_kernel(refs, has_h0, prec):
    n = pl.program_id(0)
    Kp, bv = refs["S_in"].shape[1], refs["S_in"].shape[2]
    S0 = refs["h0"][...] if has_h0 else jnp.zeros((Kp, bv), F32)
    s0 = refs["first"][n]

    def body(c, S):
        s = s0 + c
        refs["S_in"][s] = S
        U = refs["u"][s] + ptr.matmul(refs["w"][s], S, (1, 0), prec)
        refs["U"][s] = U
        return (refs["tot"][s][:, None] * S + ptr.matmul(refs["b_out"][s], U, (0, 0), prec)
                + ptr.matmul(refs["k_out"][s], refs["v"][s], (0, 0), prec))

    refs["ht"][...] = lax.fori_loop(0, refs["count"][n], body, S0)


def _forward(u, w, b_out, k_out, v, tot, h0, first, count, prec):
    S, H, BT, Vp = u.shape
    Kp = w.shape[-1]
    N = first.shape[0]
    bv = _bv(Kp, Vp)
    sp = _specs(S, BT, Kp, bv)
    ins = [("first", first, _full(first)), ("count", count, _full(count)),
           ("u", u, sp["vvec"]), ("w", w, sp["kvec"]), ("b_out", b_out, sp["kvec"]),
           ("k_out", k_out, sp["kvec"]), ("v", v, sp["vvec"]), ("tot", tot, sp["tot"])]
    if h0 is not None:
        ins.append(("h0", h0, sp["state"]))
    outs = [("U", jax.ShapeDtypeStruct((S, H, BT, Vp), F32), sp["vvec"]),
            ("S_in", jax.ShapeDtypeStruct((S, H, Kp, Vp), F32), sp["states"]),
            ("ht", jax.ShapeDtypeStruct((N, H, Kp, Vp), F32), sp["state"])]
    res = _call(lambda refs: _fwd_kernel(refs, h0 is not None, prec), ins, outs,
                (N, H, Vp // bv), "dplr_state_fwd")
    valid = slot_valid(first, count, S)
    return _mask(res["U"], valid), _mask(res["S_in"], valid), res["ht"]


def _bwd_kernel(refs, has_h0, prec):
    n = pl.program_id(0)
    dS0 = refs["dht"][...]
    s0, nc = refs["first"][n], refs["count"][n]

    def body(i, dS):
        s = s0 + nc - 1 - i
        dU = refs["dU"][s] + ptr.matmul(refs["b_out"][s], dS, (1, 0), prec)
        refs["du"][s] = dU
        refs["dv"][s] = ptr.matmul(refs["k_out"][s], dS, (1, 0), prec)
        S_in = refs["S_in"][s]
        refs["dw"][s] = ptr.matmul(dU, S_in, (1, 1), prec)
        refs["db_out"][s] = ptr.matmul(refs["U"][s], dS, (1, 1), prec)
        refs["dk_out"][s] = ptr.matmul(refs["v"][s], dS, (1, 1), prec)
        refs["dtot"][s] = jnp.sum(S_in * dS, axis=1)
        return (refs["tot"][s][:, None] * dS + ptr.matmul(refs["w"][s], dU, (0, 0), prec)
                + refs["dS_in"][s])

    dS = lax.fori_loop(0, nc, body, dS0)
    if has_h0:
        refs["dh0"][...] = dS


def _backward(res, cts, has_h0, prec):
    w, b_out, k_out, v, tot, U, S_in, first, count = res
    dU, dS_in, dht = (x.astype(F32) for x in cts)
    S, H, BT, Vp = U.shape
    Kp = w.shape[-1]
    N = first.shape[0]
    bv = _bv(Kp, Vp)
    nv = Vp // bv
    sp = _specs(S, BT, Kp, bv)
    ins = [("first", first, _full(first)), ("count", count, _full(count)),
           ("w", w, sp["kvec"]), ("b_out", b_out, sp["kvec"]), ("k_out", k_out, sp["kvec"]),
           ("v", v, sp["vvec"]), ("tot", tot, sp["tot"]), ("U", U, sp["vvec"]),
           ("S_in", S_in, sp["states"]), ("dU", dU, sp["vvec"]),
           ("dS_in", dS_in, sp["states"]), ("dht", dht, sp["state"])]
    kpart = jax.ShapeDtypeStruct((nv, S, H, BT, Kp), F32)
    outs = [("du", jax.ShapeDtypeStruct((S, H, BT, Vp), F32), sp["vvec"]),
            ("dv", jax.ShapeDtypeStruct((S, H, BT, Vp), F32), sp["vvec"]),
            ("dw", kpart, sp["kpart"]), ("db_out", kpart, sp["kpart"]),
            ("dk_out", kpart, sp["kpart"]),
            ("dtot", jax.ShapeDtypeStruct((nv, S, H, Kp), F32), sp["tpart"])]
    if has_h0:
        outs.append(("dh0", jax.ShapeDtypeStruct((N, H, Kp, Vp), F32), sp["state"]))
    r = _call(lambda refs: _bwd_kernel(refs, has_h0, prec), ins, outs, (N, H, nv),
              "dplr_state_bwd")
    valid = slot_valid(first, count, S)
    part = lambda x: _mask(jnp.sum(x, axis=0), valid)     # noqa: E731
    return (_mask(r["du"], valid), part(r["dw"]), part(r["db_out"]), part(r["dk_out"]),
            _mask(r["dv"], valid), part(r["dtot"]), r.get("dh0"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def dplr_state(u, w, b_out, k_out, v, tot, h0, first, count, prec):
    """(u [S,H,BT,Vp], w, b_out, k_out [S,H,BT,Kp], v [S,H,BT,Vp], tot [S,H,Kp], h0
    [N,H,Kp,Vp] or None, first, count int32 [N]) -> (U [S,H,BT,Vp], S_in [S,H,Kp,Vp],
    final state [N,H,Kp,Vp]), fp32. prec: the fp32 dot precision."""
    return _forward(u, w, b_out, k_out, v, tot, h0, first, count, prec)


def _fwd(u, w, b_out, k_out, v, tot, h0, first, count, prec):
    U, S_in, ht = _forward(u, w, b_out, k_out, v, tot, h0, first, count, prec)
    return (U, S_in, ht), (w, b_out, k_out, v, tot, U, S_in, first, count, h0)


def _bwd(prec, res, cts):
    has_h0 = res[-1] is not None
    du, dw, db, dk, dv, dtot, dh0 = _backward(res[:-1], cts, has_h0, prec)
    return du, dw, db, dk, dv, dtot, dh0, None, None


dplr_state.defvjp(_fwd, _bwd)
