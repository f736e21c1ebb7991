"""Inter-chunk state pass of a DPLR recurrence (Pallas, Triton lowering), forward and
backward (jax.custom_vjp): the mirror of fla_torch/ops/common/engine/dplr_state.py.

Slot layout [S, H, BT, D] fp32 (dplr.py). Per sequence n, its chunks are the slots
first[n] .. first[n] + count[n] - 1. One program per (sequence, head, V block) carries the
state S [K, BV] fp32 (the whole K) through them:
    S_in[slot] = S;   U = u + w S;   S <- diag(tot) S + b_out^T U + k_out^T v
(k_out^T v per chunk by a batched matmul first)
(u, w: the chunk's solved WY terms; b_out, k_out, tot from dplr_scores.py). Backward, dS the
gradient of the state after the chunk (dht at the end):
    dU = dU_ext + b_out dS;   du = dU;   dv = k_out dS;   dw = dU S_in^T;
    db_out = U dS^T;   dk_out = v dS^T;   dtot = rowsum(S_in * dS);
    dS <- diag(tot) dS + w^T dU + dS_in_ext[slot];   dh0 = dS before the first chunk.
The kernel carries dS and stores it per chunk (dh) with dU; dw, db_out, dk_out, dv, dtot are
chunk-parallel products of dh (batched fp32 matmuls). Slots of no chunk (varlen gaps) are
never visited; `slot_valid` masks them to zero.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from ..compute_operands import einsum

F32 = jnp.float32


# the sequential kernels' warps and V block (None: _bv's choice); benchmarks may override.
LAUNCH = {"warps": 4, "bv": None}


def _bv(Kp, Vp):
    """V block of the sequential kernels (the torch twin's choice from offline sm_90a
    spill counts: 32, 16 for K > 128)."""
    if LAUNCH["bv"] is not None:
        return min(Vp, LAUNCH["bv"])
    return min(Vp, 16 if Kp > 128 else 32)


def _prod(spec, a, b, prec):
    """A chunk-parallel product of the pass (XLA): both operands in bf16 accumulated in fp32
    for ptr.BF16 (a bf16 problem), else at the library's fp32 matmul precision."""
    if isinstance(prec, str) and prec == ptr.BF16:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        if ptr.interpret():
            # XLA:CPU has no bf16 x bf16 -> fp32 dot for every layout (DotThunk): the same
            # rounded operands multiplied in fp32 (their products are exact in fp32)
            return jnp.einsum(spec, a.astype(F32), b.astype(F32),
                              precision=lax.Precision.HIGHEST)
        return jnp.einsum(spec, a, b, preferred_element_type=F32)
    return einsum(spec, a, b)


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
                         compiler_params=ptr.compiler_params(LAUNCH["warps"], 1),
                         interpret=ptr.interpret(), name=name)(*[a for _, a, _ in ins])
    return dict(zip([n for n, _, _ in outs], res))


def _fwd_kernel(refs, has_h0, prec):
    n = pl.program_id(0)
    Kp, bv = refs["S_in"].shape[1], refs["S_in"].shape[2]
    S0 = refs["h0"][...] if has_h0 else jnp.zeros((Kp, bv), F32)
    s0 = refs["first"][n]

    def body(c, S):
        s = s0 + c
        refs["S_in"][s] = S.astype(refs["S_in"].dtype)
        U = refs["u"][s] + ptr.dot(refs["w"][s], S, (1, 0), prec)
        refs["U"][s] = U.astype(refs["U"].dtype)
        return (refs["tot"][s][:, None] * S + ptr.dot(refs["b_out"][s], U, (0, 0), prec)
                + refs["kv"][s])

    refs["ht"][...] = lax.fori_loop(0, refs["count"][n], body, S0)


def _forward(u, w, b_out, k_out, v, tot, h0, first, count, prec, dense):
    S, H, BT, Vp = u.shape
    Kp = w.shape[-1]
    N = first.shape[0]
    bv = _bv(Kp, Vp)
    sp = _specs(S, BT, Kp, bv)
    kv = _prod("shck,schv->shkv", k_out, v, prec)          # the chunk-parallel part of the update
    ins = [("first", first, _full(first)), ("count", count, _full(count)),
           ("u", u, sp["vvec"]), ("w", w, sp["kvec"]), ("b_out", b_out, sp["kvec"]),
           ("kv", kv, sp["states"]), ("tot", tot, sp["tot"])]
    if h0 is not None:
        ins.append(("h0", h0, sp["state"]))
    sd = ptr.store_dtype(prec)                        # U, S_in: BF16 products only
    outs = [("U", jax.ShapeDtypeStruct((S, H, BT, Vp), sd), sp["vvec"]),
            ("S_in", jax.ShapeDtypeStruct((S, H, Kp, Vp), sd), sp["states"]),
            ("ht", jax.ShapeDtypeStruct((N, H, Kp, Vp), F32), sp["state"])]
    res = _call(lambda refs: _fwd_kernel(refs, h0 is not None, prec), ins, outs,
                (N, H, Vp // bv), "dplr_state_fwd")
    if dense:                                         # every slot holds a chunk
        return res["U"], res["S_in"], res["ht"]
    valid = slot_valid(first, count, S)
    return _mask(res["U"], valid), _mask(res["S_in"], valid), res["ht"]


def _bwd_kernel(refs, has_h0, prec):
    n = pl.program_id(0)
    dS0 = refs["dht"][...]
    s0, nc = refs["first"][n], refs["count"][n]

    def body(i, dS):
        s = s0 + nc - 1 - i
        refs["dh"][s] = dS
        dU = refs["dU"][s] + ptr.dot(refs["b_out"][s], dS, (1, 0), prec)
        refs["du"][s] = dU
        return (refs["tot"][s][:, None] * dS + ptr.dot(refs["w"][s], dU, (0, 0), prec)
                + refs["dS_in"][s])

    dS = lax.fori_loop(0, nc, body, dS0)
    if has_h0:
        refs["dh0"][...] = dS


def _backward(res, cts, has_h0, prec, dense):
    w, b_out, k_out, v, tot, U, S_in, first, count = res
    dU, dS_in, dht = cts       # dU, dS_in in U's / S_in's dtype (the kernel reads either)
    dht = dht.astype(F32)
    S, H, BT, Vp = U.shape
    Kp = w.shape[-1]
    N = first.shape[0]
    bv = _bv(Kp, Vp)
    sp = _specs(S, BT, Kp, bv)
    ins = [("first", first, _full(first)), ("count", count, _full(count)),
           ("w", w, sp["kvec"]), ("b_out", b_out, sp["kvec"]), ("tot", tot, sp["tot"]),
           ("dU", dU, sp["vvec"]), ("dS_in", dS_in, sp["states"]), ("dht", dht, sp["state"])]
    outs = [("du", jax.ShapeDtypeStruct((S, H, BT, Vp), F32), sp["vvec"]),
            ("dh", jax.ShapeDtypeStruct((S, H, Kp, Vp), F32), sp["states"])]
    if has_h0:
        outs.append(("dh0", jax.ShapeDtypeStruct((N, H, Kp, Vp), F32), sp["state"]))
    r = _call(lambda refs: _bwd_kernel(refs, has_h0, prec), ins, outs, (N, H, Vp // bv),
              "dplr_state_bwd")
    du, dh = r["du"], r["dh"]
    if not dense:
        valid = slot_valid(first, count, S)
        du, dh = _mask(du, valid), _mask(dh, valid)
    # the chunk-parallel rest: dh is the gradient of the state after each chunk
    return (du, _prod("shcv,shkv->shck", du, S_in, prec).astype(w.dtype),
            _prod("shcv,shkv->shck", U, dh, prec).astype(b_out.dtype),
            _prod("schv,shkv->shck", v, dh, prec).astype(k_out.dtype),
            _prod("shck,shkv->schv", k_out, dh, prec).astype(v.dtype),
            jnp.sum(S_in.astype(F32) * dh, axis=-1),
            r.get("dh0"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def dplr_state(u, w, b_out, k_out, v, tot, h0, first, count, prec, dense=False):
    """(u [S,H,BT,Vp], w, b_out, k_out [S,H,BT,Kp], v [S,BT,H,Vp] (token-major), tot
    [S,H,Kp], h0
    [N,H,Kp,Vp] or None, first, count int32 [N]) -> (U [S,H,BT,Vp], S_in [S,H,Kp,Vp],
    final state [N,H,Kp,Vp]), fp32; for prec ptr.BF16, w, b_out, k_out may come and U, S_in
    go in bf16 (ptr.store_dtype). prec: the fp32 dot precision. dense: every slot holds a
    chunk (fixed length), so none is masked to zero."""
    return _forward(u, w, b_out, k_out, v, tot, h0, first, count, prec, dense)


def _fwd(u, w, b_out, k_out, v, tot, h0, first, count, prec, dense=False):
    U, S_in, ht = _forward(u, w, b_out, k_out, v, tot, h0, first, count, prec, dense)
    return (U, S_in, ht), (w, b_out, k_out, v, tot, U, S_in, first, count, h0)


def _bwd(prec, dense, res, cts):
    has_h0 = res[-1] is not None
    du, dw, db, dk, dv, dtot, dh0 = _backward(res[:-1], cts, has_h0, prec, dense)
    return du, dw, db, dk, dv, dtot, dh0, None, None


dplr_state.defvjp(_fwd, _bwd)
