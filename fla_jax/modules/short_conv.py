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
    compute dtype; packed sequences: x [1, T, D], cu_seqlens [N+1], cache [N, D, W].
    Products are accumulated in float32; the result is in the compute dtype.
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
        B, T, D = x.shape
        W = self.kernel_size
        if D != self.hidden_size:
            raise ValueError(f"ShortConvolution: x has {D} channels ([B, T, D] = "
                             f"{list(x.shape)}); expected D = hidden_size = {self.hidden_size}")
        cd = compute_dtype(x, self.dtype)
        x = x.astype(cd)
        if cu_seqlens is not None:
            return self._forward_varlen(x, cache, output_final_state, cu_seqlens, cd)
        if cache is None:
            prefix = jnp.zeros((B, W - 1, D), cd)
        else:
            if tuple(cache.shape) != (B, D, W):
                raise ValueError(f"ShortConvolution: cache has shape {list(cache.shape)}; "
                                 f"expected [B, D, W] = [{B}, {D}, {W}]")
            prefix = jnp.swapaxes(cache[:, :, 1:], 1, 2).astype(cd)
        xp = jnp.concatenate([prefix, x], axis=1)                  # [B, T + W - 1, D]
        y = self._combine([xp[:, j:j + T] for j in range(W)], cd)
        final = jnp.swapaxes(xp[:, -W:], 1, 2) if output_final_state else None
        return y, final

    def _combine(self, taps, cd):
        """taps[j]: [..., D] input seen by filter tap j -> act(sum_j w[:, j] taps[j] + b)."""
        w = self.weight[...][:, 0, :].astype(jnp.float32)          # [D, W]
        y = taps[0].astype(jnp.float32) * w[:, 0]
        for j in range(1, len(taps)):
            y = y + taps[j].astype(jnp.float32) * w[:, j]
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        if self.activation is not None:
            y = jax.nn.silu(y)
        return y.astype(cd)

    def _forward_varlen(self, x, cache, output_final_state, cu_seqlens, cd):
        """Packed sequences: x [1, T, D], cu_seqlens [N+1] (may be traced); cache None or
        [N, D, W]. No tap reads across a sequence boundary; before its start a sequence reads
        its cache row (or zeros)."""
        B, T, D = x.shape
        W = self.kernel_size
        N = cu_seqlens.shape[0] - 1
        if B != 1:
            raise ValueError(f"ShortConvolution: cu_seqlens given with batch size B={B}; "
                             f"expected B == 1 (sequences packed along T)")
        if cache is not None and tuple(cache.shape) != (N, D, W):
            raise ValueError(f"ShortConvolution: cache has shape {list(cache.shape)}; expected "
                             f"[N, D, W] = [{N}, {D}, {W}] (one row per sequence)")
        cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
        t = jnp.arange(T)
        seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, N - 1)
        start = cu[seq]

        def read(pos, rel, rows):
            inside = x[0, jnp.clip(pos, 0, T - 1)]
            if cache is None:
                before = jnp.zeros_like(inside)
            else:
                before = cache[rows, :, jnp.clip(W + rel, 0, W - 1)].astype(cd)
            return jnp.where((rel >= 0)[:, None], inside, before)

        taps = [read(t - (W - 1 - j), t - (W - 1 - j) - start, seq)[None] for j in range(W)]
        y = self._combine(taps, cd)
        final = None
        if output_final_state:
            rows = jnp.arange(N)
            cols = [read(cu[1:] - W + i, cu[1:] - W + i - cu[:-1], rows) for i in range(W)]
            final = jnp.stack(cols, axis=-1)                       # [N, D, W]
        return y, final
