"""Inverse of a unit lower-triangular matrix (I + L), batched, in plain matmuls.

Used by the WY / UT transform of the chunked delta rule. Recursive block inversion:
starting from the 1x1 diagonal blocks (inverse 1), two neighbouring inverted blocks A^-1,
D^-1 with the block C below A combine as

    [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]],

log2(C) levels of batched matmuls, all parallel, differentiable by autodiff.

Why not jax.scipy.linalg.solve_triangular: on CPU (jaxlib 0.10.x) its LAPACK trsm kernel
splits the batch over XLA's intra-op thread pool and waits for the pieces; two such solves
running at once (the backward pass has independent ones) can block every worker of a small
pool (2 cores) and deadlock.
"""
from __future__ import annotations

import jax.numpy as jnp

from .compute_operands import einsum


def _diagonal_blocks(m, size: int):
    """m: [..., C, C] -> [..., C // size, size, size], the blocks on the diagonal."""
    *lead, C, _ = m.shape
    nb = C // size
    blocks = m.reshape(*lead, nb, size, nb, size)
    diag = jnp.diagonal(blocks, axis1=-4, axis2=-2)          # [..., size, size, nb]
    return jnp.moveaxis(diag, -1, -3)


def unit_lower_inverse(lower):
    """lower: [..., C, C], strictly lower triangular (entries on/above the diagonal are
    ignored). Returns (I + lower)^-1: [..., C, C], unit lower triangular."""
    *lead, C, _ = lower.shape
    size = 1
    while size < C:
        size *= 2
    if size != C:   # extend with an identity block: (I + L) stays block lower triangular
        lower = jnp.pad(lower, [(0, 0)] * len(lead) + [(0, size - C), (0, size - C)])
    n = size
    mask = jnp.arange(n)[:, None] > jnp.arange(n)[None, :]
    lower = jnp.where(mask, lower, 0.0)
    inv = jnp.ones((*lead, n, 1, 1), lower.dtype)             # inverses of the 1x1 blocks
    s = 1
    while s < n:
        pairs = inv.reshape(*lead, n // (2 * s), 2, s, s)
        a_inv, d_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
        c = _diagonal_blocks(lower, 2 * s)[..., s:, :s]       # [..., n/2s, s, s]
        below = -einsum("...ij,...jk->...ik", einsum("...ij,...jk->...ik", d_inv, c), a_inv)
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        bottom = jnp.concatenate([below, d_inv], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)        # [..., n/2s, 2s, 2s]
        s *= 2
    return inv.reshape(*lead, n, n)[..., :C, :C]
