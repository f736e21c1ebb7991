"""L2 normalisation of q / k over the head dimension (use_qk_l2norm_in_kernel)."""
from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2 over the last axis) + eps), in x's dtype (call it on fp32/fp64 x).

    x: [..., K] -> [..., K]. Differentiable; no in-place ops.
    """
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
