"""RMSNorm and FusedRMSNormGated (FLA's names and parameters, as in fla_torch.modules.norm).

Both normalise in float32 whatever the input dtype and return the compute dtype (`dtype`, or
the input's dtype when None). Parameters are cast to float32 for the arithmetic.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .precision import canonical, compute_dtype

_GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")


def _add_residual(x, residual, residual_in_fp32):
    if residual is None:
        return x
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {list(residual.shape)}; expected the shape of x "
                         f"{list(x.shape)}")
    out = x.astype(jnp.float32) + residual.astype(jnp.float32)
    return out if residual_in_fp32 else out.astype(x.dtype)


def rms_normalize(x, weight, bias, eps: float):
    """x [..., D] -> float32 x / sqrt(mean(x^2) + eps) * weight + bias."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (+ bias), over the last axis.

    Args: hidden_size (D), elementwise_affine (weight [D], ones), bias (bias [D], zeros), eps,
    dtype (compute / output; None = input dtype), param_dtype (storage), rngs (unused; kept
    for a uniform constructor). __call__(x, residual=None, prenorm=False,
    residual_in_fp32=False)."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, bias: bool = False,
                 eps: float = 1e-5, *, dtype=None, param_dtype=jnp.float32, rngs=None):
        self.hidden_size, self.eps = hidden_size, eps
        self.elementwise_affine = elementwise_affine
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        self.weight = (nnx.Param(jnp.ones((hidden_size,), self.param_dtype))
                       if elementwise_affine else None)
        self.bias = (nnx.Param(jnp.zeros((hidden_size,), self.param_dtype))
                     if elementwise_affine and bias else None)

    def __call__(self, x, residual=None, prenorm: bool = False, residual_in_fp32: bool = False):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm: x has last dim {x.shape[-1]} (shape {list(x.shape)}); "
                             f"expected hidden_size = {self.hidden_size}")
        out_dtype = compute_dtype(x, self.dtype)
        summed = _add_residual(x, residual, residual_in_fp32)
        y = rms_normalize(summed, None if self.weight is None else self.weight[...],
                          None if self.bias is None else self.bias[...], self.eps)
        y = y.astype(out_dtype)
        return (y, summed) if prenorm else y


class FusedRMSNormGated(nnx.Module):
    """y = RMSNorm(x) * act(g), act = swish/silu (g * sigmoid(g)) or sigmoid; all in float32.

    Args: hidden_size, elementwise_affine, eps, activation, dtype, param_dtype, rngs (unused).
    __call__(x [..., D], g [..., D], residual=None, prenorm=False, residual_in_fp32=False)."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", *, dtype=None, param_dtype=jnp.float32, rngs=None):
        if activation not in _GATE_ACTIVATIONS:
            raise ValueError(f"FusedRMSNormGated: activation={activation!r}; expected one of "
                             f"{', '.join(_GATE_ACTIVATIONS)}")
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        self.elementwise_affine = elementwise_affine
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        self.weight = (nnx.Param(jnp.ones((hidden_size,), self.param_dtype))
                       if elementwise_affine else None)

    def __call__(self, x, g, residual=None, prenorm: bool = False,
                 residual_in_fp32: bool = False):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"FusedRMSNormGated: x has last dim {x.shape[-1]} (shape "
                             f"{list(x.shape)}); expected hidden_size = {self.hidden_size}")
        if g.shape != x.shape:
            raise ValueError(f"FusedRMSNormGated: g has shape {list(g.shape)}; expected the "
                             f"shape of x {list(x.shape)}")
        out_dtype = compute_dtype(x, self.dtype)
        summed = _add_residual(x, residual, residual_in_fp32)
        y = rms_normalize(summed, None if self.weight is None else self.weight[...], None,
                          self.eps)
        gf = g.astype(jnp.float32)
        gate = jax.nn.silu(gf) if self.activation in ("swish", "silu") else jax.nn.sigmoid(gf)
        y = (y * gate).astype(out_dtype)
        return (y, summed) if prenorm else y
