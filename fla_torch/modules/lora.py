"""LoRA: FLA's low-rank projection of RWKV-6/7 (name, constructor and parameters:
lora.0.weight [r, in], lora.2.weight [out, r], lora.2.bias [out] when bias)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..dtypes import gate_dtype
from .precision import linear, no_autocast, resolve_policy, storage_dtype

_ACTIVATIONS = {None: nn.Identity, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "relu": nn.ReLU}


class LoRA(nn.Module):
    """y = lora.2(act(lora.0(x))), a rank-`low_rank_dim` projection input_dim -> output_dim.

    Args (FLA's): input_dim, output_dim, low_rank_dim, bias (lora.2 has a bias), activation
        (None | 'sigmoid' | 'tanh' | 'relu'). Ours: device, dtype (storage), policy.
    Initialisation (FLA's): lora.0 zeros, lora.2 orthogonal with gain 0.1 (x sqrt(r / out)
    when r > out), bias zeros.
    forward(x [..., input_dim], dtype=None) -> [..., output_dim] in `dtype` (default: the
    policy's compute dtype, else x's dtype): both products in `dtype` (accumulated in fp32),
    the activation in float32 (float64 for a float64 dtype). Pass dtype=torch.float32 for a decay path (incident 3).
    """

    def __init__(self, input_dim: int, output_dim: int, low_rank_dim: int,
                 bias: bool | None = True, activation: str | None = "tanh", device=None,
                 dtype=None, policy=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"LoRA: activation={activation!r}; expected one of None, "
                             f"'sigmoid', 'tanh', 'relu'")
        self.input_dim, self.output_dim, self.low_rank_dim = input_dim, output_dim, low_rank_dim
        self.bias = bias
        self.policy = resolve_policy(policy)
        f = {"device": device, "dtype": storage_dtype(dtype, self.policy)}
        self.lora = nn.Sequential(nn.Linear(input_dim, low_rank_dim, bias=False, **f),
                                  _ACTIVATIONS[activation](),
                                  nn.Linear(low_rank_dim, output_dim, bias=bool(bias), **f))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.lora[0].weight)
        out, r = self.lora[2].weight.shape
        gain = math.sqrt(r / out) if r > out else 1.0
        w = torch.empty(out, r, dtype=torch.float32, device=self.lora[2].weight.device)
        nn.init.orthogonal_(w, gain=gain * 0.1)
        self.lora[2].weight.copy_(w)
        if self.lora[2].bias is not None:
            nn.init.zeros_(self.lora[2].bias)

    @torch.no_grad()
    def set_bias_value(self, value) -> None:
        """Set lora.2's bias (a tensor [output_dim] or a number); no-op without a bias."""
        if self.lora[2].bias is not None:
            if isinstance(value, torch.Tensor):
                self.lora[2].bias.copy_(value.to(self.lora[2].bias.dtype))
            else:
                self.lora[2].bias.fill_(value)

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if x.shape[-1] != self.input_dim:
            raise ValueError(f"LoRA: x has last dim {x.shape[-1]} (shape {list(x.shape)}); "
                             f"expected input_dim = {self.input_dim}")
        if dtype is None:
            dtype = self.policy.compute_dtype if self.policy is not None else x.dtype
        h = linear(x, self.lora[0], dtype)
        with no_autocast(h):
            h = self.lora[1](h.to(gate_dtype(dtype))).to(dtype)
        return linear(h, self.lora[2], dtype)
