"""Gate arithmetic inside a chunk, stable for strong gates (log-decay down to -20 per token).

b = inclusive cumsum of the log-decay within the chunk (non-increasing). Every exponent is
made <= 0 before exp: pairwise differences b_i - b_j are masked to j <= i BEFORE exp (the
upper triangle would overflow), b_C - b_j <= 0 and b_i <= 0.
"""
from __future__ import annotations

import jax.numpy as jnp

from ... import dtypes


def causal_mask(C: int, inclusive: bool = True):
    """[C, C] bool: j <= i (inclusive) or j < i (strict)."""
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    return (j <= i) if inclusive else (j < i)


def pairwise_decay(b, inclusive: bool = True):
    """b: [..., C] scalar cumulative log-decay -> [..., C, C] with exp(b_i - b_j) where j <= i
    (j < i if not inclusive) and 0 elsewhere."""
    C = b.shape[-1]
    mask = causal_mask(C, inclusive)
    diff = jnp.where(mask, b[..., :, None] - b[..., None, :], 0.0)
    return jnp.where(mask, jnp.exp(diff), 0.0)


def chunk_cumsum(g):
    """Inclusive cumsum over the chunk axis: g [B, NC, HV, C] or [B, NC, HV, C, K].

    A product with the [C, C] lower-triangular ones matrix at the library's fp32 matmul
    precision: XLA:CPU lowers jnp.cumsum over a non-minor axis to a slow reduce-window
    (about 5x slower than this matmul at C = 64)."""
    C = g.shape[3]
    tri = causal_mask(C).astype(g.dtype)                              # [C (i), C (j)]
    if g.ndim == 4:
        return jnp.einsum("bnhj,ij->bnhi", g, tri, precision=dtypes.matmul_precision(),
                          preferred_element_type=g.dtype)
    return jnp.einsum("bnhjk,ij->bnhik", g, tri, precision=dtypes.matmul_precision(),
                      preferred_element_type=g.dtype)
