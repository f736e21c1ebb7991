"""Host side (XLA) of the Mosaic GPU delta-rule forward: the token rows in the chunk-aligned
layout (common/mosaic/packing.py), the gate vectors and the gate-free inverse T0.

Rows: fixed length [B, T] is padded to [B, Tp] and flattened to R = B * Tp rows; varlen
(B == 1) packs each sequence to start at a chunk boundary (R = Tp rows). Padding rows are
zero (q = k = v = 0, g = 0, beta = 0), which leaves the state untouched.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..common.mosaic import packing
from ..common.pallas_delta_layout import l2norm_fwd
from ..common.unit_lower_inverse import unit_lower_inverse
from .mosaic_fwd_kernel import C, TABLE_WIDTH
from .mosaic_kkt import gate_free_inverse_mosaic

F32 = jnp.float32
LOG2E = math.log2(math.e)


def plan(B: int, T: int, cu_seqlens):
    """The packing layout and the kernel's per-sequence table int32 [N, TABLE_WIDTH]
    (first chunk, chunk count)."""
    lay = packing.plan(T, cu_seqlens, C, TABLE_WIDTH)
    if lay.seq is not None:
        return lay, lay.seq
    nc = lay.Tp // C
    table = jnp.zeros((B, TABLE_WIDTH), jnp.int32)
    table = table.at[:, 0].set(jnp.arange(B, dtype=jnp.int32) * nc).at[:, 1].set(nc)
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


def gate_vectors(g_rows, R: int, HV: int):
    """g_rows: [R, HV] fp32 log-decay or None. Returns, in log2 units, G (chunk-local
    cumsum) and G_last - G (the sum over the later tokens of the chunk), both [HV, R] fp32."""
    if g_rows is None:
        z = jnp.zeros((HV, R), F32)
        return z, z
    g = g_rows.astype(F32).T.reshape(HV, R // C, C)
    G = jnp.cumsum(g, axis=-1)
    later = jnp.cumsum(g[..., ::-1], axis=-1)[..., ::-1] - g
    return (G * LOG2E).reshape(HV, R), (later * LOG2E).reshape(HV, R)


# Where T0 is formed: "mosaic" (mosaic_kkt.py: one chunk-parallel kernel, the doubling on the
# tensor cores) or "xla" (a batched einsum and unit_lower_inverse's levels of small matmuls).
# Both match float64 alike (interpreted on CPU). H100, bf16 B4 T4096 H16 K=V=128 (RESULTS.md
# run 14): the Mosaic forward 0.673 ms with "xla", 0.394 with "mosaic".
T0_KERNELS = ("xla", "mosaic")
T0_KERNEL = "mosaic"


def gate_free_inverse(k_rows, beta_rows, group: int, dtype, gcum=None):
    """k_rows: [R, H, K] (16-bit); beta_rows: [R, HV] fp32. Returns T0 = (I + tril(beta_i
    k_i . k_j, -1))^-1 per chunk and value head as [HV, R, C] in `dtype` (products exact,
    fp32 accumulation and inverse), formed as T0_KERNEL says. With gcum ([HV, R] fp32, G in
    log2 units) returns (T0, -W' [HV, R, K]), the backward's WY keys (wy_keys)."""
    if T0_KERNEL not in T0_KERNELS:
        raise ValueError(f"mosaic_layout.T0_KERNEL={T0_KERNEL!r}; expected one of {T0_KERNELS}")
    if T0_KERNEL == "mosaic":
        return gate_free_inverse_mosaic(k_rows, beta_rows.astype(F32).T, group, dtype,
                                        gcum=gcum)
    t0 = _gate_free_inverse_xla(k_rows, beta_rows, group, dtype)
    if gcum is None:
        return t0
    return t0, wy_keys(k_rows, t0, gcum, beta_rows.astype(F32).T, group)


def _gate_free_inverse_xla(k_rows, beta_rows, group: int, dtype):
    R, H, K = k_rows.shape
    HV = beta_rows.shape[1]
    kc = k_rows.reshape(R // C, C, H, K)
    kk = jnp.einsum("nihk,njhk->nhij", kc, kc, preferred_element_type=F32,
                    precision=lax.Precision.HIGHEST)
    kk = jnp.repeat(kk, group, axis=1)                                  # [NC, HV, C, C]
    b = beta_rows.astype(F32).reshape(R // C, C, HV).transpose(0, 2, 1)
    t0 = unit_lower_inverse(kk * b[..., :, None])                      # [NC, HV, C, C]
    return t0.astype(dtype).transpose(1, 0, 2, 3).reshape(HV, R, C)


def _dot16(spec, a, b):
    """einsum of 16-bit a, b with fp32 accumulation (XLA:CPU has no 16-bit x 16-bit -> fp32
    dot: there the rounded operands are multiplied in fp32, which gives the same products)."""
    if jax.default_backend() == "cpu":
        return jnp.einsum(spec, a.astype(F32), b.astype(F32), precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum(spec, a, b, preferred_element_type=F32)


def wy_keys(k_rows, t0, gcum, beta_t, group: int):
    """W' = exp2(-G_0) W = (T0 * D) diag(beta exp2(G - G_0)) k per chunk (W as the forward
    kernel forms v_new from it, relative to the chunk's first row: no fp16 underflow under
    strong gates). k_rows: [R, H, K] (16-bit); t0: [HV, R, C] (q's dtype); gcum, beta_t:
    [HV, R] fp32 (G in log2 units). Returns -W' [HV, R, K] in k's dtype (the reverse pass'
    operand)."""
    R, H, K = k_rows.shape
    HV = t0.shape[0]
    NC = R // C
    g = gcum.reshape(HV, NC, C)
    idx = jnp.arange(C)
    dec = jnp.exp2(jnp.where(idx[:, None] >= idx[None, :], g[..., :, None] - g[..., None, :],
                             -jnp.inf))
    scale = beta_t.reshape(HV, NC, C) * jnp.exp2(g - g[..., :1])      # beta Gamma' (columns)
    agk = (t0.reshape(HV, NC, C, C).astype(F32) * dec * scale[..., None, :]).astype(k_rows.dtype)
    kc = jnp.repeat(k_rows.reshape(NC, C, H, K), group, axis=2)        # [NC, C, HV, K]
    w = _dot16("hnij,njhk->hnik", agk, kc)
    return (-w).astype(k_rows.dtype).reshape(HV, R, K)
