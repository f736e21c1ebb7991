"""Bring q / k / v to the compute dtype and to one key head per value head.

Shared by the reference and chunked implementations of every family.
"""
from __future__ import annotations

import torch

from ...dtypes import gate_dtype
from .l2norm import l2norm


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs: the dtype every reference/chunked op computes in."""
    return gate_dtype(q.dtype)


def expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, T, HV, D]; value head hv reads head hv // (HV // H)."""
    H = x.shape[2]
    if H == HV:
        return x
    return x.repeat_interleave(HV // H, dim=2)


def prepare_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                use_qk_l2norm: bool = False):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (any float dtype).

    Returns (q, k, v) in the compute dtype (fp32, fp64 for fp64 inputs) with q, k
    l2-normalised over K when asked and expanded to [B, T, HV, K].
    """
    cd = compute_dtype(q)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    HV = v.shape[2]
    return expand_heads(q, HV), expand_heads(k, HV), v


def group_sum(x: torch.Tensor, H: int) -> torch.Tensor:
    """[B, T, HV, K] per-value-head gradient -> [B, T, H, K] (value heads hv // (HV//H))."""
    B, T, HV, K = x.shape
    if HV == H:
        return x
    return x.view(B, T, H, HV // H, K).sum(3)
