"""Host side (XLA) of the Mosaic GPU delta-rule forward: the token rows in the chunk-aligned
layout (common/mosaic/packing.py), the gate vectors and the entry to the gate-free inverse T0.

Rows: fixed length [B, T] is padded to [B, Tp] and flattened to R = B * Tp rows; varlen
(B == 1) packs each sequence to start at a chunk boundary (R = Tp rows). Padding rows are
zero (q = k = v = 0, g = 0, beta = 0), which leaves the state untouched.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..common.mosaic import packing
from ..common.pallas_delta_layout import l2norm_fwd
from .mosaic_fwd_kernel import C, TABLE_WIDTH
from .mosaic_kkt import gate_free_inverse_mosaic

F32 = jnp.float32
LOG2E = math.log2(math.e)


def plan(B: int, T: int, cu_seqlens):
    """The packing layout and the kernel's per-sequence table int32 [N, TABLE_WIDTH]
    (first chunk, chunk count): numpy for fixed length, a jax array (traced) for varlen."""
    lay = packing.plan(T, cu_seqlens, C, TABLE_WIDTH)
    if lay.seq is not None:
        return lay, lay.seq
    nc = lay.Tp // C
    # numpy: a constant of the program, as are the piece tables formed from it
    # (mosaic_pieces.py; no XLA kernels per call: 4 of ~1 us each when formed by jnp)
    table = np.zeros((B, TABLE_WIDTH), np.int32)
    table[:, 0], table[:, 1] = np.arange(B) * nc, nc
    return lay, table


def to_rows(x, lay):
    """[B, T, ...] -> [R, ...]."""
    y = packing.pack(x, lay)
    return y.reshape(y.shape[0] * y.shape[1], *y.shape[2:])


def from_rows(y, lay, B: int):
    """[R, ...] -> [B, T, ...]."""
    return packing.unpack(y.reshape(B, lay.Tp, *y.shape[1:]), lay)


def l2norm(x):
    """x / sqrt(sum(x^2) + 1e-6) over K in fp32, back in x's dtype."""
    return l2norm_fwd(x).astype(x.dtype)


# How G_last - G is formed: "difference" (the default: G_last - G from the one cumsum; fp32
# cancellation, absolute error ~2^-24 |G_last|, i.e. ~3e-5 relative in exp2(G_last - G) at
# |G_last| = 460) or "sum" (a second, reversed cumsum: each entry a sum of the later tokens'
# gates). H100 (RESULTS.md run 24 call 3): the gate vectors alone 11.7 -> 8.6 us of device
# time at R = 16384, 20.3 -> 10.5 at 32768; GDN B4 T4096 bf16 0.199 / 0.876 -> 0.197 / 0.860 ms
LATER = "difference"
LATERS = ("sum", "difference")


def gate_vectors(g_rows, R: int, HV: int):
    """g_rows: [R, HV] fp32 log-decay or None. Returns, in log2 units, G (chunk-local
    cumsum) and G_last - G (the sum over the later tokens of the chunk), both [HV, R] fp32."""
    if LATER not in LATERS:
        raise ValueError(f"mosaic_layout.LATER={LATER!r}; expected one of {LATERS}")
    if g_rows is None:
        z = jnp.zeros((HV, R), F32)
        return z, z
    g = g_rows.astype(F32).T.reshape(HV, R // C, C)
    G = jnp.cumsum(g, axis=-1)
    if LATER == "sum":
        later = jnp.cumsum(g[..., ::-1], axis=-1)[..., ::-1] - g
    else:
        later = G[..., -1:] - G
    return (G * LOG2E).reshape(HV, R), (later * LOG2E).reshape(HV, R)


def gate_free_inverse(k_rows, beta_t, group: int, dtype, *, gcum=None, v_rows=None,
                      with_t0: bool = True):
    """k_rows: [R, H, K] (16-bit); beta_t: [HV, R] fp32 (beta's rows transposed, as
    mosaic_gates.gate_inputs gives them). The gate-free inverse T0 = (I +
    tril(beta_i k_i . k_j, -1))^-1 per chunk and value head [HV, R, C] (with_t0) and, from it,
    with gcum ([HV, R] fp32, G in log2 units) and v_rows ([R, HV, V]) the WY factors -W'
    [HV, R, K] and U^T [HV, V, R], all in `dtype`, as a tuple in that order (mosaic_kkt.py: one
    chunk-parallel Mosaic kernel; the H100 forward 0.673 ms with T0 from XLA, 0.394 with it,
    RESULTS.md run 14)."""
    return gate_free_inverse_mosaic(k_rows, beta_t, group, dtype, gcum=gcum, v_rows=v_rows,
                                    with_t0=with_t0)
