"""ShortConvolution: causal depthwise 1-D convolution over time with a decode cache
(FLA's name and parameters: weight [D, 1, W], optional bias [D], as in torch)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from .precision import canonical, compute_dtype, uniform_init

_ACTIVATIONS = (None, "silu", "swish")


class ShortConvolution(nnx.Module):
    """y[t] = act(bias + sum_j weight[:, 0, j] * x[t - (W - 1) + j]), x[<0] = 0 (or the cache).

    Args: hidden_size (D), kernel_size (W), bias, activation (None | 'silu' | 'swish'),
    dtype (compute; None = input dtype), param_dtype (storage), rngs.
    Cache (`conv_state`): [B, D, W], the last W inputs, newest last (FLA's layout), in the
    compute dtype. Products are accumulated in float32; the result is in the compute dtype.
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False,
                 activation: str | None = "silu", *, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs, **kwargs):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"ShortConvolution: activation={activation!r}; expected one of "
                             f"None, 'silu', 'swish'")
        self.hidden_size, self.kernel_size = hidden_size, kernel_size
        self.activation = activation
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        bound = 1.0 / math.sqrt(kernel_size)
        self.weight = nnx.Param(uniform_init(rngs.params(), (hidden_size, 1, kernel_size),
                                             bound, self.param_dtype))
        self.bias = (nnx.Param(uniform_init(rngs.params(), (hidden_size,), bound,
                                            self.param_dtype)) if bias else None)

    def __call__(self, x, cache=None, output_final_state: bool = False, cu_seqlens=None):
        """x: [B, T, D]; cache: None or [B, D, W]. Returns (y [B, T, D] in the compute dtype,
        final cache [B, D, W] or None unless output_final_state)."""
        if cu_seqlens is not None:
            raise NotImplementedError("ShortConvolution: cu_seqlens (packed sequences) is not "
                                      "supported yet; pass a padded batch [B, T, D]")
        B, T, D = x.shape
        W = self.kernel_size
        if D != self.hidden_size:
            raise ValueError(f"ShortConvolution: x has {D} channels ([B, T, D] = "
                             f"{list(x.shape)}); expected D = hidden_size = {self.hidden_size}")
        cd = compute_dtype(x, self.dtype)
        x = x.astype(cd)
        if cache is None:
            prefix = jnp.zeros((B, W - 1, D), cd)
        else:
            if tuple(cache.shape) != (B, D, W):
                raise ValueError(f"ShortConvolution: cache has shape {list(cache.shape)}; "
                                 f"expected [B, D, W] = [{B}, {D}, {W}]")
            prefix = jnp.swapaxes(cache[:, :, 1:], 1, 2).astype(cd)
        xp = jnp.concatenate([prefix, x], axis=1)                  # [B, T + W - 1, D]
        w = self.weight[...][:, 0, :].astype(jnp.float32)          # [D, W]
        y = xp[:, 0:T].astype(jnp.float32) * w[:, 0]
        for j in range(1, W):
            y = y + xp[:, j:j + T].astype(jnp.float32) * w[:, j]
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        if self.activation is not None:
            y = jax.nn.silu(y)
        final = jnp.swapaxes(xp[:, -W:], 1, 2) if output_final_state else None
        return y.astype(cd), final
