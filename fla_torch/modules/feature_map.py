"""HadamardFeatureMap: FLA's learnable 'elementwise_product' feature map for LinearAttention."""
from __future__ import annotations

import torch
import torch.nn as nn

from .precision import linear


class HadamardFeatureMap(nn.Module):
    """phi(x) = layer1(x) * layer2(x); layer1, layer2: Linear(head_dim, head_dim) with bias.

    forward(x [..., head_dim], dtype=None) -> [..., head_dim] in `dtype` (default x.dtype);
    the parameters are cast to that dtype first."""

    def __init__(self, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.layer1 = nn.Linear(head_dim, head_dim, device=device, dtype=dtype)
        self.layer2 = nn.Linear(head_dim, head_dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = x.dtype if dtype is None else dtype
        return linear(x, self.layer1, dtype) * linear(x, self.layer2, dtype)
