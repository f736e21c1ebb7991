"""HadamardFeatureMap: FLA's learnable 'elementwise_product' feature map for LinearAttention."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from .linear import Linear


class HadamardFeatureMap(nnx.Module):
    """phi(x) = layer1(x) * layer2(x); layer1, layer2: Linear(head_dim, head_dim) with bias.
    __call__(x [..., head_dim], dtype=None) -> same shape in `dtype` (default x.dtype)."""

    def __init__(self, head_dim: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.layer1 = Linear(head_dim, head_dim, param_dtype=param_dtype, rngs=rngs)
        self.layer2 = Linear(head_dim, head_dim, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, dtype=None):
        dtype = x.dtype if dtype is None else dtype
        return self.layer1(x, dtype) * self.layer2(x, dtype)
