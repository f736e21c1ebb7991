"""Host side (XLA) of the Mosaic GPU GLA forward: per chunk of C = 64 rows of the chunk-aligned
layout (gated_delta_rule/mosaic_layout.py), from b the chunk-local inclusive cumsum of the
per-key log-decay g (log2 units, fp32) and `last` its value on the chunk's last row:
    qg = q exp2(b),  kg = k exp2(last - b)          [R, H, K] in q's dtype (factors <= 1)
    el = exp2(last)                                   [H, NC, K] fp32 (the state's decay)
    A_ij = sum_c q_ic k_jc exp2(b_ic - b_jc), j <= i  [H, R, C] in q's dtype
A is formed like the Pallas engine's cumsum_scores: in sub-chunks of 16 rows with reference
r_I = b on the row before sub-chunk I; rows of I against the earlier sub-chunks' keys as
(q exp2(b - r_I)) . (k exp2(r_I - b)), both factors <= 1, one batched product with 16-bit
operands and fp32 accumulation; the diagonal 16 x 16 blocks exactly, per pair and channel in
fp32 (no factor ever exceeds 1, so no overflow under any gate strength).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..common.mosaic.tiles import LOG2E

F32 = jnp.float32
SUB = 16


def chunk_gates(g_rows, C: int):
    """g_rows: [R, H, K] log-decay. Returns b [NC, C, H, K] (chunk-local inclusive cumsum,
    log2 units, fp32)."""
    R, H, K = g_rows.shape
    return jnp.cumsum(g_rows.astype(F32).reshape(R // C, C, H, K), axis=1) * LOG2E


def scores(q_rows, k_rows, b, dtype):
    """q_rows, k_rows: [R, H, K]; b: [NC, C, H, K] from chunk_gates. Returns A [H, R, C] in
    `dtype` (see the module docstring)."""
    NC, C, H, K = b.shape
    ns = C // SUB
    q = q_rows.astype(F32).reshape(NC, ns, SUB, H, K)
    k = k_rows.astype(F32).reshape(NC, C, H, K)
    bs = b.reshape(NC, ns, SUB, H, K)
    # reference of sub-chunk I: b on the row before it (sub-chunk 0 has no earlier keys)
    ref = jnp.concatenate([jnp.zeros_like(bs[:, :1, 0]), bs[:, :-1, -1]], axis=1)  # [NC,ns,H,K]
    qf = (q * jnp.exp2(bs - ref[:, :, None])).astype(dtype)                      # <= 1
    j = lax.broadcasted_iota(jnp.int32, (1, ns, C, 1, 1), 2)
    earlier = j < SUB * lax.broadcasted_iota(jnp.int32, (1, ns, C, 1, 1), 1)
    expo = jnp.where(earlier, ref[:, :, None] - b[:, None], -jnp.inf)          # [NC,ns,C,H,K]
    kf = (k[:, None] * jnp.exp2(expo)).astype(dtype)                             # <= 1
    off = jnp.einsum("nisd,nijd->nisj",                       # [NC, H, ns, SUB, C]
                     qf.transpose(0, 3, 1, 2, 4).reshape(NC * H, ns, SUB, K),
                     kf.transpose(0, 3, 1, 2, 4).reshape(NC * H, ns, C, K),
                     preferred_element_type=F32)
    # diagonal blocks, exact: sum_c q_sc k_tc exp2(b_sc - b_tc), t <= s (exponent masked first)
    keep = (lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
            <= lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0))[None, None, :, :, None, None]
    ks = k.reshape(NC, ns, SUB, H, K)
    dexp = jnp.where(keep, bs[:, :, :, None] - bs[:, :, None, :], -jnp.inf)  # [NC,ns,s,t,H,K]
    diag = jnp.sum(q[:, :, :, None] * ks[:, :, None, :] * jnp.exp2(dexp), axis=-1)
    diag = diag.transpose(0, 4, 1, 2, 3).reshape(NC * H, ns, SUB, SUB)
    for blk in range(ns):   # the earlier-key part is zero in these columns
        off = off.at[:, blk, :, blk * SUB:(blk + 1) * SUB].add(diag[:, blk])
    a = off.reshape(NC, H, C, C).transpose(1, 0, 2, 3).reshape(H, NC * C, C)
    return a.astype(dtype)


def factors(q_rows, k_rows, b, dtype):
    """qg, kg [R, H, K] in `dtype` and el [H, NC, K] fp32 (see the module docstring)."""
    NC, C, H, K = b.shape
    last = b[:, -1]
    qg = (q_rows.astype(F32).reshape(NC, C, H, K) * jnp.exp2(b)).astype(dtype)
    kg = (k_rows.astype(F32).reshape(NC, C, H, K) * jnp.exp2(last[:, None] - b)).astype(dtype)
    return (qg.reshape(NC * C, H, K), kg.reshape(NC * C, H, K),
            jnp.exp2(last).transpose(1, 0, 2))
