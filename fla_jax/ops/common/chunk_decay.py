"""Gate arithmetic inside a chunk, stable for strong gates (log-decay down to -20 per token).

b = inclusive cumsum of the log-decay within the chunk (non-increasing). Every exponent is
made <= 0 before exp: pairwise differences b_i - b_j are masked to j <= i BEFORE exp (the
upper triangle would overflow), b_C - b_j <= 0 and b_i <= 0.

Gradients stay accurate under strong gates because no zero-length gap is formed as a
difference: the decay of a token to itself is the constant 1 (not exp(b_i - b_i), whose O(1)
gradient reaches b_i twice and cancels), and the decay to the chunk's end is a direct suffix
sum of g (`chunk_suffix`, not b_C - b_j). With every gate in [-20, -10] all other gradient
terms are decayed, and the cancelled O(1) ones cost fp32 dg errors of 6e-3..1e-2.
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
    strict = causal_mask(C, inclusive=False)
    diff = jnp.where(strict, b[..., :, None] - b[..., None, :], 0.0)
    out = jnp.where(strict, jnp.exp(diff), 0.0)
    return out + jnp.eye(C, dtype=out.dtype) if inclusive else out


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


def chunk_suffix(g, axis: int = 3):
    """Exclusive suffix sums over the chunk axis, sum_{s > j} g_s (the log-decay from token j
    to the chunk's end): g [B, NC, HV, C] (axis 3) or a sub-chunked [..., c, K] (axis -2).
    A product with the strict upper-triangular ones matrix (see `chunk_cumsum`); the
    gradient of g_s collects only the tokens j < s, so the last token's O(1) term never
    enters (b_C - b_j would add and subtract it)."""
    C = g.shape[axis]
    later = causal_mask(C, inclusive=False).T.astype(g.dtype)         # [j, s]: s > j
    g = jnp.moveaxis(g, axis, -1)
    out = jnp.einsum("...s,js->...j", g, later, precision=dtypes.matmul_precision(),
                     preferred_element_type=g.dtype)
    return jnp.moveaxis(out, -1, axis)
