"""The engine's scalar-gate delta rule (Pallas, WY / UT transform): the stages in order, forward
and backward, for GATE_SCALAR (g [R, HV]: chunk_gated_delta_rule) and GATE_NONE (g None:
chunk_delta_rule). Kernels: scalar_wy_fwd.py (W, U, Tm per chunk), scalar_delta_fwd.py (the
sequential state / output kernel), scalar_delta_bwd.py (reverse dh pass, per-chunk gradients
with the WY backward); launch tiles: launch.delta_tiles (BT, value blocks, warps, stages from
K, V, dtype). The Triton twin is fla_torch's engine/scalar_delta.py.

q, k, v are read in place ([B, T, H, D] viewed as [B*T, H, D]); varlen is handled inside the
kernels through cu_seqlens (may be traced): chunk slots of engine/varlen.py (`slot_table`:
the (start, end) of each slot and each sequence's first slot), no host sync.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..dispatch import pallas_interpret
from ..pallas_delta_layout import dot_precision, triton_params
from .launch import delta_tiles
from . import varlen as vl
from .scalar_delta_bwd import chunk_dh, chunk_grads
from .scalar_delta_fwd import _state_out_kernel
from .scalar_wy_fwd import wy_prep

F32 = jnp.float32


def _pad_rows(interpret, BT, *xs):
    """The interpreter clamps out-of-range windows instead of masking them: give every chunk
    window real rows to read (the GPU path reads the arrays in place)."""
    if not interpret:
        return xs
    return tuple(None if x is None else jnp.pad(x, [(0, BT)] + [(0, 0)] * (x.ndim - 1))
                 for x in xs)


def _slots(cu, R, BT, fixed_len):
    """varlen.slot_table for R flattened tokens: fixed_len (each sequence's length) or None
    (cu_seqlens given)."""
    if fixed_len is None:
        return vl.slot_table(cu, R, BT, True)
    return vl.slot_table(cu, fixed_len, BT, False)


def delta_forward(q, k, v, g, beta, h0, cu, *, scale, l2norm, resid, fixed_len):
    """q, k: [R, H, K]; v: [R, HV, V]; g (or None), beta: [R, HV] fp32; h0: [N, HV, K, V] fp32
    or None; cu int32 [N+1]. resid: None, "u" (token-serial backward: u fp32 [R, HV, V]) or
    "h" (chunk backward: w, U [rows, HV, K|V], v_new [rows, HV, V] and the chunk start
    states h [slots, HV, K, V] and Tm [slots, HV, BT, BT], all in q's dtype; rows = R, + BT
    when interpreted). fixed_len: each sequence's length (no cu_seqlens), or None (varlen).
    Returns o [R, HV, V], ht [N, HV, K, V] fp32 and the residual tuple (empty for None)."""
    R, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu.shape[0] - 1
    tiles = delta_tiles(K, V, q.dtype)
    BT = tiles.BT
    interpret = pallas_interpret()
    q, k, v, g, beta = _pad_rows(interpret, BT, q, k, v, g, beta)
    rows = q.shape[0]
    table, first = _slots(cu, R, BT, fixed_len)
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


def delta_backward(q, k, v, g, beta, h0, cu, w, uu, vn, hs, tm, do, dht, *, scale, l2norm,
                   fixed_len, dqk_dtype=F32):
    """Chunk-parallel backward (scalar_delta_bwd.py). Returns per-value-head dq, dk
    [R, HV, K] in dqk_dtype (fp32; the caller passes q's dtype when they are final: no value
    groups to sum, no l2norm backward), dv [R, HV, V] (v's dtype), dbeta [R, HV] fp32,
    dg [R, HV] fp32 (or None), dh0 (or None)."""
    R = q.shape[0]
    tiles = delta_tiles(q.shape[2], v.shape[2], q.dtype)
    BT = tiles.BT
    interpret = pallas_interpret()
    q, k, v, g, beta, do = _pad_rows(interpret, BT, q, k, v, g, beta, do)
    table, first = _slots(cu, R, BT, fixed_len)
    dh, dvn, dh0 = chunk_dh(q, k, w, do, g, dht, cu, first, n_slots=table.shape[0],
                            has_h0=h0 is not None, scale=scale, l2norm=l2norm, BT=BT,
                            tile=tiles.dh)
    dq, dk, dv, db, dg = chunk_grads(q, k, v, g, beta, do, w, uu, vn, hs, dh, dvn, tm, table,
                                     scale=scale, l2norm=l2norm, BT=BT, tile=tiles.grads,
                                     dqk_dtype=dqk_dtype)
    return dq[:R], dk[:R], dv[:R], db[:R], (None if dg is None else dg[:R]), dh0
