"""How fla_jax modules choose and apply their compute dtype (Flax's `dtype` / `param_dtype`).

- Parameters are stored in `param_dtype` (default float32).
- The compute dtype of a call is the module's `dtype` when set; when `dtype` is None it is the
  dtype of the input activation. (Flax's own default would promote an fp16 input with fp32
  parameters to fp32; here it stays fp16: parity_tests/test_modules_dtype.py.)
- Parameters are cast to the compute dtype before they touch activations.
- Gates, log-decays and beta are computed in float32 whatever `dtype` says.
- Matmuls accumulate in float32 at full precision unless `fla_jax.dtypes.allow_tf32()`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..dtypes import matmul_precision, to_dtype


def canonical(dtype):
    """None stays None; 'bf16' / jnp.bfloat16 / np.dtype -> the jnp scalar type."""
    return None if dtype is None else to_dtype(dtype)


def compute_dtype(x, dtype):
    """`dtype` when given, else x.dtype."""
    return x.dtype if dtype is None else dtype


def uniform_init(key, shape, bound: float, param_dtype):
    """U(-bound, bound) drawn in float32, stored in param_dtype (torch's default Linear/Conv
    initialisation uses bound = 1 / sqrt(fan_in))."""
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(param_dtype)


def dense(x, weight, bias, dtype):
    """x [..., in] @ weight[out, in]^T (+ bias) with x, weight, bias cast to `dtype` first,
    accumulated in float32, returned in `dtype`."""
    acc = jnp.float64 if np.dtype(dtype) == np.dtype(jnp.float64) else jnp.float32
    y = jnp.einsum("...i,oi->...o", x.astype(dtype), weight.astype(dtype),
                   precision=matmul_precision(), preferred_element_type=acc)
    if bias is not None:
        y = y + bias.astype(dtype).astype(acc)
    return y.astype(dtype)
