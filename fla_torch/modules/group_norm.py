"""GroupNorm over the channels of the last dimension (the parameters of FLA's GroupNorm and
of torch's nn.GroupNorm: weight [D], bias [D])."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..dtypes import gate_dtype
from .precision import no_autocast, resolve_policy, storage_dtype


class GroupNorm(nn.Module):
    """y = (x - mean_g) / sqrt(var_g + eps) * weight + bias, statistics per group of
    D / num_groups consecutive channels, in float32 whatever the input dtype (float64 for float64).

    Args: num_groups, hidden_size (D, a multiple of num_groups), elementwise_affine (weight
        ones, bias zeros when bias), bias, eps; device, dtype (storage), policy.
    forward(x [..., D]) -> [..., D] in the policy's compute dtype, else x's dtype.
    """

    def __init__(self, num_groups: int, hidden_size: int, elementwise_affine: bool = True,
                 bias: bool = True, eps: float = 1e-5, device=None, dtype=None, policy=None):
        super().__init__()
        if hidden_size % num_groups != 0:
            raise ValueError(f"GroupNorm: hidden_size={hidden_size} is not divisible by "
                             f"num_groups={num_groups}")
        self.num_groups, self.hidden_size, self.eps = num_groups, hidden_size, eps
        self.elementwise_affine = elementwise_affine
        self.policy = resolve_policy(policy)
        f = {"device": device, "dtype": storage_dtype(dtype, self.policy)}
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, **f))
            if bias:
                self.bias = nn.Parameter(torch.zeros(hidden_size, **f))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"GroupNorm: x has last dim {x.shape[-1]} (shape "
                             f"{list(x.shape)}); expected hidden_size = {self.hidden_size}")
        out_dtype = self.policy.compute_dtype if self.policy is not None else x.dtype
        f32 = gate_dtype(x.dtype)
        with no_autocast(x):
            xf = x.to(f32).unflatten(-1, (self.num_groups, -1))
            mean = xf.mean(-1, keepdim=True)
            var = (xf - mean).square().mean(-1, keepdim=True)
            y = ((xf - mean) * torch.rsqrt(var + self.eps)).flatten(-2)
            if self.weight is not None:
                y = y * self.weight.to(f32)
            if self.bias is not None:
                y = y + self.bias.to(f32)
        return y.to(out_dtype)
