"""The WY terms of a DPLR chunk (Pallas, Triton lowering), forward and backward
(jax.custom_vjp): the mirror of fla_torch/ops/common/engine/dplr_wy.py (whose backward lives
in dplr_tail.py, fused with the state pass's chunk products; here it is this stage's own
kernel).

Slot layout (dplr.py), fp32: A_ab, A_ak [S, H, BT, BT] (A_ab strictly lower; entries on and
above its diagonal are ignored), v [S, H, BT, Vp], a_in [S, H, BT, Kp]. Per chunk, with
T = (I - A_ab)^-1 (unit lower triangular):
    u = T (A_ak v)  [S, H, BT, Vp],     w = T a_in  [S, H, BT, Kp].
Forward: one program per (slot, head) inverts I - A_ab by blocks of 16 rows in registers,
    T_ii = (I - A_ii)^-1 = (I + A)(I + A^2)(I + A^4)(I + A^8)     (A^16 = 0)
    T_ij = T_ii sum_{j <= m < i} A_im T_mj                          (i > j),
stores T (the backward's), and forms u, w block row by block row (no [BT, BT] tile of T is
assembled in registers). Backward, one program per (slot, head), X = A_ak v:
    dX = T^T du,  dA_ak = dX v^T,  dv = A_ak^T dX,  da_in = T^T dw,
    dA_ab = strictly-lower part of T^T (du X^T + dw a_in^T) T^T.
Every product is fp32-accurate (`prec`: tf32x3 on the GPU unless allow_tf32(); for 16-bit
problems ptr.SPLIT3, three bf16 products, except in the inversion).
This replaces the batched jnp inverse (common/unit_lower_inverse.py, six levels of small
XLA matmuls) and its autodiff in the DPLR pipeline.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from .launch import Launch, blocks, call

F32 = jnp.float32
B16 = 16                       # block rows of the inversion
LAUNCH = Launch(64, 64, 4, 1)  # bk, bv: K / V column blocks of u, w and the backward


def _blk(ref, I, J):
    """Block (I, J) [16, 16] of a [BT, BT] ref."""
    return ref[pl.ds(I * B16, B16), pl.ds(J * B16, B16)]


def _strict_lower(x):
    ii = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    jj = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.where(ii > jj, x, 0.0)


def inv_diag(a, prec):
    """(I - a)^-1 of a [16, 16] block (only its strictly lower part is used): a^16 = 0, so it
    is a^0 + .. + a^15 = (I + a)(I + a^2)(I + a^4)(I + a^8), three squarings and three
    products (no 16-step substitution)."""
    a = _strict_lower(a)
    eye = (lax.broadcasted_iota(jnp.int32, a.shape, 0)
           == lax.broadcasted_iota(jnp.int32, a.shape, 1)).astype(F32)
    p, t = a, eye + a
    for _ in range(3):
        p = ptr.dot(p, p, (1, 0), prec)
        t = t + ptr.dot(t, p, (1, 0), prec)
    return t


def _inverse_blocks(A, nb, prec):
    """{(i, j): T_ij [16, 16]} for j <= i of T = (I - A)^-1, A a [BT, BT] ref (fp32-accurate
    products even for 16-bit problems: tf32x3 where prec is SPLIT3)."""
    if isinstance(prec, str):                       # SPLIT3 / BF16: inversion in tf32x3
        prec = ptr.accurate_precision()
    T = {(i, i): inv_diag(_blk(A, i, i), prec) for i in range(nb)}
    for d in range(1, nb):
        for j in range(nb - d):
            i = j + d
            acc = sum(ptr.dot(_blk(A, i, m), T[m, j], (1, 0), prec) for m in range(j, i))
            T[i, j] = ptr.dot(T[i, i], acc, (1, 0), prec)
    return T


def _fwd_kernel(refs, prec):
    BT = refs["A_ab"].shape[0]
    nb = BT // B16
    T = _inverse_blocks(refs["A_ab"], nb, prec)
    zero = jnp.zeros((B16, B16), F32)
    for i in range(nb):
        for j in range(nb):
            refs["T"][pl.ds(i * B16, B16), pl.ds(j * B16, B16)] = T[i, j] if j <= i else zero

    def rows_of(src_blocks, out, width):
        """out[rows of block i] = sum_{j <= i} T_ij src_j for every column block."""
        n = out.shape[1] // width

        def col(c, carry):
            cols = pl.ds(c * width, width)
            src = [src_blocks(j, cols) for j in range(nb)]
            for i in range(nb):
                acc = sum(ptr.dot(T[i, j], src[j], (1, 0), prec) for j in range(i + 1))
                out[pl.ds(i * B16, B16), cols] = acc.astype(out.dtype)
            return carry

        blocks(n, col)

    def x_block(j, cols):                     # rows of block j of X = A_ak v
        return ptr.dot(refs["A_ak"][pl.ds(j * B16, B16), :], refs["v"][:, cols], (1, 0), prec)

    def a_block(j, cols):
        return refs["a_in"][pl.ds(j * B16, B16), cols]

    rows_of(x_block, refs["u"], min(LAUNCH.bv, refs["u"].shape[1]))
    rows_of(a_block, refs["w"], min(LAUNCH.bk, refs["w"].shape[1]))


def _bwd_kernel(refs, prec):
    Tm = refs["T"][...]                       # [BT, BT]
    A_ak = refs["A_ak"][...]
    BT = Tm.shape[0]
    Vp, Kp = refs["v"].shape[1], refs["a_in"].shape[1]
    bv, bk = min(LAUNCH.bv, Vp), min(LAUNCH.bk, Kp)

    def vblock(c, acc):
        dT, dAak = acc
        cols = pl.ds(c * bv, bv)
        v, du = refs["v"][:, cols], refs["du"][:, cols]
        X = ptr.dot(A_ak, v, (1, 0), prec)                       # [BT, bv]
        dX = ptr.dot(Tm, du, (0, 0), prec)                       # T^T du
        refs["dv"][:, cols] = ptr.dot(A_ak, dX, (0, 0), prec).astype(refs["dv"].dtype)
        return (dT + ptr.dot(du, X, (1, 1), prec), dAak + ptr.dot(dX, v, (1, 1), prec))

    def kblock(c, dT):
        cols = pl.ds(c * bk, bk)
        a, dw = refs["a_in"][:, cols], refs["dw"][:, cols]
        refs["da_in"][:, cols] = ptr.dot(Tm, dw, (0, 0), prec).astype(refs["da_in"].dtype)
        return dT + ptr.dot(dw, a, (1, 1), prec)

    z = jnp.zeros((BT, BT), F32)
    nv, nk = Vp // bv, Kp // bk
    dT, dAak = blocks(nv, vblock, (z, z))
    dT = blocks(nk, kblock, dT)
    refs["dA_ak"][...] = dAak.astype(refs["dA_ak"].dtype)
    # dA_ab = T^T dT T^T (d(I - A)^-1 = T dA T), its strictly lower part
    left = ptr.dot(Tm, dT, (0, 0), prec)
    refs["dA_ab"][...] = _strict_lower(ptr.dot(left, Tm, (1, 1), prec))


def _spec(BT, D):
    return pl.BlockSpec((None, None, BT, D), lambda s, h: (s, h, 0, 0))


def _tok_spec(BT, D):
    """v and dv: token-major [S, BT, H, Vp] (dplr.py's layout of the op's inputs)."""
    return pl.BlockSpec((None, BT, None, D), lambda s, h: (s, 0, h, 0))


def _forward(A_ab, A_ak, v, a_in, prec):
    S, BT, H, Vp = v.shape
    Kp = a_in.shape[-1]
    if BT != 64:
        raise ValueError(f"dplr_wy: chunk length {BT}; the block inversion expects 64")
    mat = pl.BlockSpec((None, None, BT, BT), lambda s, h: (s, h, 0, 0))
    ins = [("A_ab", A_ab, mat), ("A_ak", A_ak, mat), ("v", v, _tok_spec(BT, Vp)),
           ("a_in", a_in, _spec(BT, Kp))]
    outs = [("T", jax.ShapeDtypeStruct((S, H, BT, BT), F32), mat),
            ("u", jax.ShapeDtypeStruct((S, H, BT, Vp), F32), _spec(BT, Vp)),
            ("w", jax.ShapeDtypeStruct((S, H, BT, Kp), a_in.dtype), _spec(BT, Kp))]
    r = call(lambda refs: _fwd_kernel(refs, prec), (S, H), ins, outs, LAUNCH, "dplr_wy_fwd")
    return r["T"], r["u"], r["w"]


def _backward(Tm, A_ak, v, a_in, du, dw, prec):
    S, BT, H, Vp = v.shape
    Kp = a_in.shape[-1]
    mat = pl.BlockSpec((None, None, BT, BT), lambda s, h: (s, h, 0, 0))
    ins = [("T", Tm, mat), ("A_ak", A_ak, mat), ("v", v, _tok_spec(BT, Vp)),
           ("a_in", a_in, _spec(BT, Kp)), ("du", du, _spec(BT, Vp)), ("dw", dw, _spec(BT, Kp))]
    outs = [("dA_ab", jax.ShapeDtypeStruct((S, H, BT, BT), F32), mat),
            ("dA_ak", jax.ShapeDtypeStruct((S, H, BT, BT), A_ak.dtype), mat),
            ("dv", jax.ShapeDtypeStruct((S, BT, H, Vp), v.dtype), _tok_spec(BT, Vp)),
            ("da_in", jax.ShapeDtypeStruct((S, H, BT, Kp), a_in.dtype), _spec(BT, Kp))]
    r = call(lambda refs: _bwd_kernel(refs, prec), (S, H), ins, outs, LAUNCH, "dplr_wy_bwd")
    return r["dA_ab"], r["dA_ak"], r["dv"], r["da_in"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def dplr_wy(A_ab, A_ak, v, a_in, prec):
    """(A_ab, A_ak [S, H, 64, 64], v [S, 64, H, Vp] (token-major), a_in [S, H, 64, Kp], all
    fp32) ->
    (u [S, H, 64, Vp], w [S, H, 64, Kp]) fp32 (see the module docstring). prec: the fp32
    dot precision."""
    _, u, w = _forward(A_ab, A_ak, v, a_in, prec)
    return u, w


def _fwd(A_ab, A_ak, v, a_in, prec):
    Tm, u, w = _forward(A_ab, A_ak, v, a_in, prec)
    return (u, w), (Tm, A_ak, v, a_in)


def _bwd(prec, res, cts):
    du, dw = cts                 # du fp32, dw in w's dtype (the kernel reads either)
    return _backward(*res, du, dw, prec)


dplr_wy.defvjp(_fwd, _bwd)
