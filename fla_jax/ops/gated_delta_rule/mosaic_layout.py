"""Host side (XLA) of the Mosaic GPU delta-rule kernels: the chunk-aligned token layout,
the gate vectors and the gate-free inverse T0.

Chunk-aligned layout: every sequence starts at a row that is a multiple of C = 64 and its
tail is padded with zero rows (q = k = v = 0, g = 0, beta = 0, which leave the state
untouched), so each chunk holds tokens of one sequence. Without cu_seqlens this is [B, T]
padded to [B, Tp] and flattened; with cu_seqlens (B == 1, traced values allowed) tokens are
scattered to a static upper bound of R = C * (ceil(T / C) + N) rows.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from ..common.pallas_delta_layout import l2norm_fwd
from ..common.unit_lower_inverse import unit_lower_inverse
from .mosaic_fwd_kernel import TABLE_WIDTH
from .mosaic_tiles import CHUNK

F32 = jnp.float32
C = CHUNK


class Layout(NamedTuple):
    """rows: total rows R; dest: None (plain padding, B x Tp) or int32 [T] row of each
    token; table: int32 [N, TABLE_WIDTH] (first chunk, chunk count) per sequence;
    B, T, Tp: the caller's batch and length, the padded length (no cu_seqlens)."""
    rows: int
    dest: object
    table: object
    B: int
    T: int
    Tp: int


def make_layout(B: int, T: int, cu_seqlens) -> Layout:
    if cu_seqlens is None:
        Tp = -(-T // C) * C
        nc = Tp // C
        table = jnp.zeros((B, TABLE_WIDTH), jnp.int32)
        table = table.at[:, 0].set(jnp.arange(B, dtype=jnp.int32) * nc).at[:, 1].set(nc)
        return Layout(B * Tp, None, table, B, T, Tp)
    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    start = jnp.cumsum(nch) - nch
    rows = C * (-(-T // C) + N)
    seq = jnp.searchsorted(cu, jnp.arange(T, dtype=jnp.int32), side="right") - 1
    seq = jnp.clip(seq, 0, N - 1)
    dest = start[seq] * C + jnp.arange(T, dtype=jnp.int32) - cu[seq]
    table = jnp.zeros((N, TABLE_WIDTH), jnp.int32).at[:, 0].set(start).at[:, 1].set(nch)
    return Layout(rows, dest, table, B, T, T)


def to_rows(x, lay: Layout):
    """[B, T, ...] -> [R, ...] (zeros in the padding rows)."""
    if lay.dest is None:
        pad = [(0, 0), (0, lay.Tp - lay.T)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, pad).reshape(lay.rows, *x.shape[2:])
    out = jnp.zeros((lay.rows, *x.shape[2:]), x.dtype)
    return out.at[lay.dest].set(x[0], unique_indices=True)


def from_rows(x, lay: Layout):
    """[R, ...] -> [B, T, ...]."""
    if lay.dest is None:
        return x.reshape(lay.B, lay.Tp, *x.shape[1:])[:, :lay.T]
    return x[lay.dest][None]


def l2norm(x):
    """x / sqrt(sum(x^2) + 1e-6) over K in fp32, back in x's dtype."""
    return l2norm_fwd(x).astype(x.dtype)


def gate_vectors(g_rows, R: int, HV: int):
    """g_rows: [R, HV] fp32 log-decay or None. Returns G (chunk-local cumsum) and
    G_last - G (the sum over the later tokens of the chunk), both [HV, R] fp32."""
    if g_rows is None:
        z = jnp.zeros((HV, R), F32)
        return z, z
    g = g_rows.astype(F32).T.reshape(HV, R // C, C)
    G = jnp.cumsum(g, axis=-1)
    later = jnp.cumsum(g[..., ::-1], axis=-1)[..., ::-1] - g
    return G.reshape(HV, R), later.reshape(HV, R)


def gate_free_inverse(k_rows, beta_rows, group: int, dtype):
    """k_rows: [R, H, K] (16-bit); beta_rows: [R, HV] fp32. Returns T0 = (I + tril(beta_i
    k_i . k_j, -1))^-1 per chunk and value head as [HV, R, C] in `dtype`."""
    R, H, K = k_rows.shape
    HV = beta_rows.shape[1]
    kc = k_rows.reshape(R // C, C, H, K)
    kk = jnp.einsum("nihk,njhk->nhij", kc, kc, preferred_element_type=F32,
                    precision=lax.Precision.HIGHEST)
    kk = jnp.repeat(kk, group, axis=1)                                  # [NC, HV, C, C]
    b = beta_rows.astype(F32).reshape(R // C, C, HV).transpose(0, 2, 1)
    t0 = unit_lower_inverse(kk * b[..., :, None])                      # [NC, HV, C, C]
    return t0.astype(dtype).transpose(1, 0, 2, 3).reshape(HV, R, C)
