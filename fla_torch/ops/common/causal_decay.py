"""Causal decay matrices inside a chunk, formed from gate differences masked before exp.

With b the inclusive cumulative log-decay inside a chunk, the decay from token j to token i
(j <= i) is exp(b_i - b_j) <= 1. The non-causal entries (j > i) would be exp of a large
positive number for strong gates, so they are replaced by -inf BEFORE exp: no overflow, no
exp(b) * exp(-b) products, and zero gradients through the masked part.
"""
from __future__ import annotations

import torch


def causal_mask(C: int, device, strict: bool = False) -> torch.Tensor:
    """[C, C] bool: True where j <= i (j < i when strict)."""
    return torch.ones(C, C, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def scalar_decay_matrix(b: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """b: [..., C] cumulative log-decay -> [..., C, C] with exp(b_i - b_j) on the causal part,
    0 elsewhere."""
    C = b.shape[-1]
    diff = b[..., :, None] - b[..., None, :]
    mask = causal_mask(C, b.device, strict)
    return torch.where(mask, diff, torch.full((), float("-inf"), dtype=b.dtype,
                                              device=b.device)).exp()


def causal_ones(C: int, dtype: torch.dtype, device, strict: bool = False) -> torch.Tensor:
    """[C, C] float: 1 on the causal part, 0 elsewhere (the decay matrix of an ungated op)."""
    return causal_mask(C, device, strict).to(dtype)


def vector_decay_scores(q: torch.Tensor, k: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-channel decayed scores for gla.

    q, k, b: [..., C, K] (b cumulative log-decay per channel).
    Returns A [..., C, C]: A_ij = sum_k q_ik k_jk exp(b_ik - b_jk) for j <= i, 0 elsewhere.
    Memory [..., C, C, K]: keep C small.
    """
    C = b.shape[-2]
    diff = b[..., :, None, :] - b[..., None, :, :]
    mask = causal_mask(C, b.device)[..., None]
    decay = torch.where(mask, diff, torch.full((), float("-inf"), dtype=b.dtype,
                                               device=b.device)).exp()
    return torch.einsum("...ik,...jk,...ijk->...ij", q, k, decay)
