"""GroupNorm over the channels of the last axis (mirror of fla_torch.modules.group_norm;
parameters weight [D], bias [D], as FLA's GroupNorm and torch's nn.GroupNorm)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..dtypes import gate_dtype
from .precision import canonical, compute_dtype


class GroupNorm(nnx.Module):
    """y = (x - mean_g) / sqrt(var_g + eps) * weight + bias, statistics per group of
    D / num_groups consecutive channels, in float32 (float64 for float64) whatever the input.

    Args: num_groups, hidden_size (D), elementwise_affine, bias, eps; dtype (compute / output;
        None = the input's), param_dtype, rngs (unused).
    __call__(x [..., D]) -> [..., D] in the compute dtype.
    """

    def __init__(self, num_groups: int, hidden_size: int, elementwise_affine: bool = True,
                 bias: bool = True, eps: float = 1e-5, *, dtype=None, param_dtype=jnp.float32,
                 rngs=None):
        if hidden_size % num_groups != 0:
            raise ValueError(f"GroupNorm: hidden_size={hidden_size} is not divisible by "
                             f"num_groups={num_groups}")
        self.num_groups, self.hidden_size, self.eps = num_groups, hidden_size, eps
        self.elementwise_affine = elementwise_affine
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        self.weight = (nnx.Param(jnp.ones((hidden_size,), self.param_dtype))
                       if elementwise_affine else None)
        self.bias = (nnx.Param(jnp.zeros((hidden_size,), self.param_dtype))
                     if elementwise_affine and bias else None)

    def __call__(self, x):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"GroupNorm: x has last dim {x.shape[-1]} (shape "
                             f"{list(x.shape)}); expected hidden_size = {self.hidden_size}")
        out_dtype = compute_dtype(x, self.dtype)
        f32 = gate_dtype(x.dtype)
        xf = x.astype(f32).reshape(*x.shape[:-1], self.num_groups, -1)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = ((xf - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
        if self.weight is not None:
            y = y * self.weight[...].astype(f32)
        if self.bias is not None:
            y = y + self.bias[...].astype(f32)
        return y.astype(out_dtype)
