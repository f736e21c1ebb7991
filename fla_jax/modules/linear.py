"""Linear with torch's parameter layout (weight [out, in], bias [out]), so a torch state_dict
maps onto it name for name and shape for shape (see fla_jax/interop.py)."""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from .precision import canonical, compute_dtype, dense, uniform_init


class Linear(nnx.Module):
    """y = x @ weight^T + bias.

    Args: in_features, out_features, bias (learn bias [out]); dtype (compute; None = the
    input's dtype); param_dtype (storage, default float32); rngs (nnx.Rngs, 'params' stream).
    __call__(x [..., in], dtype=None) -> [..., out] in `dtype` or the module's compute dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        bound = 1.0 / math.sqrt(in_features)
        self.weight = nnx.Param(uniform_init(rngs.params(), (out_features, in_features), bound,
                                             self.param_dtype))
        self.bias = (nnx.Param(uniform_init(rngs.params(), (out_features,), bound,
                                            self.param_dtype)) if bias else None)

    def __call__(self, x, dtype=None):
        cd = dtype if dtype is not None else compute_dtype(x, self.dtype)
        return dense(x, self.weight[...], None if self.bias is None else self.bias[...], cd)
