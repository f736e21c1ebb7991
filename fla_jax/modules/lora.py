"""LoRA: FLA's low-rank projection of RWKV-6/7 (mirror of fla_torch.modules.lora; parameters
lora.0.weight [r, in], lora.2.weight [out, r], lora.2.bias [out] when bias)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..dtypes import gate_dtype
from .linear import Linear
from .precision import canonical, compute_dtype

_ACTIVATIONS = {None: lambda x: x, "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh,
                "relu": jax.nn.relu}


class Activation(nnx.Module):
    """A parameter-free activation by name (lora.1, so lora.2 keeps torch's index)."""

    def __init__(self, name):
        self.name = name

    def __call__(self, x):
        return _ACTIVATIONS[self.name](x)


class LoRA(nnx.Module):
    """y = lora.2(act(lora.0(x))), a rank-`low_rank_dim` projection input_dim -> output_dim.

    Args (FLA's): input_dim, output_dim, low_rank_dim, bias, activation (None | 'sigmoid' |
        'tanh' | 'relu'). Flax's: dtype (compute; None = the input's), param_dtype, rngs.
    Initialisation (FLA's): lora.0 zeros, lora.2 orthogonal with gain 0.1 (x sqrt(r / out)
    when r > out), bias zeros.
    __call__(x [..., input_dim], dtype=None) -> [..., output_dim] in `dtype` (default: the
    module's dtype, else x's): products in `dtype` accumulated in fp32, the activation in
    float32 (float64 for float64). Pass dtype=jnp.float32 for a decay path (incident 3).
    """

    def __init__(self, input_dim: int, output_dim: int, low_rank_dim: int,
                 bias: bool | None = True, activation: str | None = "tanh", *, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"LoRA: activation={activation!r}; expected one of None, "
                             f"'sigmoid', 'tanh', 'relu'")
        self.input_dim, self.output_dim, self.low_rank_dim = input_dim, output_dim, low_rank_dim
        self.bias = bias
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        f = {"dtype": self.dtype, "param_dtype": self.param_dtype, "rngs": rngs}
        self.lora = nnx.List([Linear(input_dim, low_rank_dim, bias=False, **f),
                              Activation(activation),
                              Linear(low_rank_dim, output_dim, bias=bool(bias), **f)])
        self.reset_parameters(rngs)

    def reset_parameters(self, rngs: nnx.Rngs) -> None:
        self.lora[0].weight.set_value(jnp.zeros_like(self.lora[0].weight[...]))
        out, r = self.lora[2].weight[...].shape
        gain = math.sqrt(r / out) if r > out else 1.0
        w = jax.nn.initializers.orthogonal(scale=gain * 0.1)(rngs.params(), (out, r),
                                                             jnp.float32)
        self.lora[2].weight.set_value(w.astype(self.param_dtype))
        if self.lora[2].bias is not None:
            self.lora[2].bias.set_value(jnp.zeros_like(self.lora[2].bias[...]))

    def set_bias_value(self, value) -> None:
        """Set lora.2's bias (an array [output_dim] or a number); no-op without a bias."""
        if self.lora[2].bias is not None:
            b = self.lora[2].bias[...]
            self.lora[2].bias.set_value(jnp.broadcast_to(jnp.asarray(value), b.shape)
                                        .astype(b.dtype))

    def __call__(self, x, dtype=None):
        if x.shape[-1] != self.input_dim:
            raise ValueError(f"LoRA: x has last dim {x.shape[-1]} (shape {list(x.shape)}); "
                             f"expected input_dim = {self.input_dim}")
        cd = dtype if dtype is not None else compute_dtype(x, self.dtype)
        h = self.lora[0](x, cd)
        h = self.lora[1](h.astype(gate_dtype(cd))).astype(cd)
        return self.lora[2](h, cd)
