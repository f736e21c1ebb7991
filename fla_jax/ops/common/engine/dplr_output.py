"""The output of a DPLR chunk (Pallas, Triton lowering, chunk-parallel), forward and backward
(jax.custom_vjp): the mirror of fla_torch/ops/common/engine/dplr_output.py.

Slot layout of dplr.py, fp32: r_in [S, H, BT, Kp], S_in [S, H, Kp, Vp], U [S, H, BT, Vp],
A_rb, A_rk [S, H, BT, BT]; v, o (and dv, do) token-major [S, BT, H, Vp] (for fixed length a
reshape of the token layout). Per chunk and head
    o = scale (r_in S_in + A_rb U + A_rk v)                          [S, BT, H, Vp]
(one program per slot, head and V block). Backward (one program per slot and head), with
do' = scale do:
    dr_in = do' S_in^T,  dS_in = r_in^T do',  dA_rb = do' U^T,  dU = A_rb^T do',
    dA_rk = do' v^T,  dv = A_rk^T do'.
Every product is fp32-accurate (`prec`). Replaces the three jnp matmuls of the output and
their six autodiff products.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from .launch import Launch, blocks, call

F32 = jnp.float32
LAUNCH = Launch(64, 64, 4, 1)     # bk, bv


def _fwd_kernel(refs, scale, prec):
    Kp = refs["r_in"].shape[1]
    bk = min(LAUNCH.bk, Kp)
    acc = ptr.dot(refs["A_rb"][...], refs["U"][...], (1, 0), prec)
    acc = acc + ptr.dot(refs["A_rk"][...], refs["v"][...], (1, 0), prec)

    def kblock(c, acc):
        cols = pl.ds(c * bk, bk)
        return acc + ptr.dot(refs["r_in"][:, cols], refs["S_in"][cols, :], (1, 0), prec)

    nk = Kp // bk
    acc = blocks(nk, kblock, acc)
    refs["o"][...] = acc * scale


def _bwd_kernel(refs, scale, prec):
    BT, Vp = refs["U"].shape
    Kp = refs["r_in"].shape[1]
    bv, bk = min(LAUNCH.bv, Vp), min(LAUNCH.bk, Kp)
    A_rb, A_rk = refs["A_rb"][...], refs["A_rk"][...]

    def vblock(c, acc):
        g_rb, g_rk = acc
        cols = pl.ds(c * bv, bv)
        do = refs["do"][:, cols] * scale
        refs["dU"][:, cols] = ptr.dot(A_rb, do, (0, 0), prec).astype(refs["dU"].dtype)
        refs["dv"][:, cols] = ptr.dot(A_rk, do, (0, 0), prec).astype(refs["dv"].dtype)

        def kblock(e, carry):
            rows = pl.ds(e * bk, bk)
            refs["dS_in"][rows, cols] = ptr.dot(refs["r_in"][:, rows], do, (0, 0),
                                                prec).astype(refs["dS_in"].dtype)
            return carry

        nk = Kp // bk
        blocks(nk, kblock)
        return (g_rb + ptr.dot(do, refs["U"][:, cols], (1, 1), prec),
                g_rk + ptr.dot(do, refs["v"][:, cols], (1, 1), prec))

    z = jnp.zeros((BT, BT), F32)
    nv = Vp // bv
    g_rb, g_rk = blocks(nv, vblock, (z, z))
    refs["dA_rb"][...] = g_rb.astype(refs["dA_rb"].dtype)
    refs["dA_rk"][...] = g_rk.astype(refs["dA_rk"].dtype)

    def kblock_r(e, carry):
        rows = pl.ds(e * bk, bk)

        def vpart(c, acc):
            cols = pl.ds(c * bv, bv)
            return acc + ptr.dot(refs["do"][:, cols], refs["S_in"][rows, cols], (1, 1), prec)

        acc = jnp.zeros((BT, bk), F32)
        acc = blocks(nv, vpart, acc)
        refs["dr_in"][:, rows] = (acc * scale).astype(refs["dr_in"].dtype)
        return carry

    nk = Kp // bk
    blocks(nk, kblock_r)


def _forward(r_in, S_in, A_rb, U, A_rk, v, scale, prec):
    S, H, BT, Kp = r_in.shape
    Vp = U.shape[-1]
    bv = min(LAUNCH.bv, Vp)
    full = lambda r, c: pl.BlockSpec((None, None, r, c), lambda s, h, j: (s, h, 0, 0))  # noqa
    vcol = lambda r: pl.BlockSpec((None, None, r, bv), lambda s, h, j: (s, h, 0, j))  # noqa
    tcol = pl.BlockSpec((None, BT, None, bv), lambda s, h, j: (s, 0, h, j))   # token-major
    ins = [("r_in", r_in, full(BT, Kp)), ("S_in", S_in, vcol(Kp)), ("A_rb", A_rb, full(BT, BT)),
           ("U", U, vcol(BT)), ("A_rk", A_rk, full(BT, BT)), ("v", v, tcol)]
    outs = [("o", jax.ShapeDtypeStruct(v.shape, F32), tcol)]
    return call(lambda refs: _fwd_kernel(refs, scale, prec), (S, H, Vp // bv), ins, outs,
                LAUNCH, "dplr_output_fwd")["o"]


def _backward(res, do, scale, prec):
    r_in, S_in, A_rb, U, A_rk, v = res
    S, H, BT, Kp = r_in.shape
    Vp = U.shape[-1]
    full = lambda r, c: pl.BlockSpec((None, None, r, c), lambda s, h: (s, h, 0, 0))  # noqa
    tok = pl.BlockSpec((None, BT, None, Vp), lambda s, h: (s, 0, h, 0))     # token-major
    ins = [("r_in", r_in, full(BT, Kp)), ("S_in", S_in, full(Kp, Vp)),
           ("A_rb", A_rb, full(BT, BT)), ("U", U, full(BT, Vp)), ("A_rk", A_rk, full(BT, BT)),
           ("v", v, tok), ("do", do, tok)]
    outs = [(n, jax.ShapeDtypeStruct(x.shape, x.dtype), full(*x.shape[2:])) for n, x in
            (("dr_in", r_in), ("dS_in", S_in), ("dA_rb", A_rb), ("dU", U), ("dA_rk", A_rk))]
    outs += [("dv", jax.ShapeDtypeStruct(v.shape, v.dtype), tok)]
    r = call(lambda refs: _bwd_kernel(refs, scale, prec), (S, H), ins, outs, LAUNCH,
             "dplr_output_bwd")
    return tuple(r[n] for n, _, _ in outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def dplr_output(r_in, S_in, A_rb, U, A_rk, v, scale, prec):
    """(r_in [S, H, BT, Kp], S_in [S, H, Kp, Vp], A_rb [S, H, BT, BT], U [S, H, BT, Vp], A_rk
    [S, H, BT, BT], v [S, BT, H, Vp]; fp32, or bf16 all but v for a BF16 prec; scale: float)
    -> o [S, BT, H, Vp] fp32 (see the module docstring); gradients in their inputs' dtypes. prec: the fp32 dot precision."""
    return _forward(r_in, S_in, A_rb, U, A_rk, v, scale, prec)


def _fwd(r_in, S_in, A_rb, U, A_rk, v, scale, prec):
    return _forward(r_in, S_in, A_rb, U, A_rk, v, scale, prec), (r_in, S_in, A_rb, U, A_rk, v)


def _bwd(scale, prec, res, do):
    return _backward(res, do.astype(F32), scale, prec)


dplr_output.defvjp(_fwd, _bwd)
