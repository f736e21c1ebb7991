"""RMSNorm and FusedRMSNormGated (FLA's names, constructors and parameters).

Both normalise in float32 whatever the input dtype (the statistics of a bf16 row are not
computed in bf16) and return the compute dtype: `policy.compute_dtype` when a policy is set,
otherwise the input's dtype. Parameters are cast to float32 for the arithmetic and never
promote the output.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .precision import no_autocast, resolve_policy, storage_dtype

_GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")


def _out_dtype(x: torch.Tensor, policy) -> torch.dtype:
    return policy.compute_dtype if policy is not None else x.dtype


def _add_residual(x, residual, residual_in_fp32):
    if residual is None:
        return x
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {list(residual.shape)}; expected the shape of x "
                         f"{list(x.shape)}")
    out = x.float() + residual.float()
    return out if residual_in_fp32 else out.to(x.dtype)


def rms_normalize(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    """x [..., D] -> float32 x / sqrt(mean(x^2) + eps) * weight + bias."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (+ bias), over the last dim.

    Args:
        hidden_size: D. elementwise_affine: learn weight [D] (ones). bias: learn bias [D].
        eps: added to the mean square. device, dtype: parameter placement / storage dtype.
        policy: optional compute policy (output dtype = policy.compute_dtype).
    forward(x [..., D], residual=None, prenorm=False, residual_in_fp32=False): with a
    residual, normalises x + residual and, if prenorm, also returns that sum.
    """

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, bias: bool = False,
                 eps: float = 1e-5, device=None, dtype=None, policy=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.policy = resolve_policy(policy)
        factory = {"device": device, "dtype": storage_dtype(dtype, self.policy)}
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, **factory))
            if bias:
                self.bias = nn.Parameter(torch.zeros(hidden_size, **factory))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                prenorm: bool = False, residual_in_fp32: bool = False):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm: x has last dim {x.shape[-1]} (shape {list(x.shape)}); "
                             f"expected hidden_size = {self.hidden_size}")
        out_dtype = _out_dtype(x, self.policy)
        with no_autocast(x):
            summed = _add_residual(x, residual, residual_in_fp32)
            y = rms_normalize(summed, self.weight, self.bias, self.eps).to(out_dtype)
        return (y, summed) if prenorm else y


class FusedRMSNormGated(nn.Module):
    """y = RMSNorm(x) * act(g), act = swish/silu (g * sigmoid(g)) or sigmoid; all in float32.

    Args:
        hidden_size: D. elementwise_affine: learn weight [D] (ones). eps. activation:
        'swish' | 'silu' | 'sigmoid'. device, dtype: parameter placement / storage dtype.
        policy: optional compute policy.
    forward(x [..., D], g [..., D], residual=None, prenorm=False, residual_in_fp32=False).
    """

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device=None, dtype=None, policy=None):
        super().__init__()
        if activation not in _GATE_ACTIVATIONS:
            raise ValueError(f"FusedRMSNormGated: activation={activation!r}; expected one of "
                             f"{', '.join(_GATE_ACTIVATIONS)}")
        self.hidden_size = hidden_size
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.activation = activation
        self.policy = resolve_policy(policy)
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device,
                                                  dtype=storage_dtype(dtype, self.policy)))

    def forward(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                prenorm: bool = False, residual_in_fp32: bool = False):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"FusedRMSNormGated: x has last dim {x.shape[-1]} (shape "
                             f"{list(x.shape)}); expected hidden_size = {self.hidden_size}")
        if g.shape != x.shape:
            raise ValueError(f"FusedRMSNormGated: g has shape {list(g.shape)}; expected the "
                             f"shape of x {list(x.shape)}")
        out_dtype = _out_dtype(x, self.policy)
        with no_autocast(x):
            summed = _add_residual(x, residual, residual_in_fp32)
            y = rms_normalize(summed, self.weight, self.bias, self.eps)
            gf = g.float()
            gate = F.silu(gf) if self.activation in ("swish", "silu") else torch.sigmoid(gf)
            y = (y * gate).to(out_dtype)
        return (y, summed) if prenorm else y
