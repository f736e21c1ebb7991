"""Causal decays inside a chunk, formed as segment sums of the log-decays, masked before exp.

The decay from token j to token i (j <= i) inside a chunk is exp(G_ij) with
    G_ij = g_{j+1} + ... + g_i   (G_ii = 0).
G is computed as a masked cumulative sum of g (never as a difference b_i - b_j of prefix
sums), and the non-causal part (j > i) is set to -inf BEFORE exp. So:
- no overflow for strong gates (every exponent is <= 0 for g <= 0), no exp(b) * exp(-b);
- no cancellation: G's autograd sends each g_s only the pairs (i, j) with j < s <= i, so the
  gradient of g stays at rounding level even when strong gates make it tiny (differences of
  prefix sums would cost ~1e-4 relative error in fp32 there);
- the last row G[C-1, j] = g_{j+1} + ... + g_C is the decay from token j to the chunk's end.
"""
from __future__ import annotations

import torch


def causal_mask(C: int, device, strict: bool = False) -> torch.Tensor:
    """[C, C] bool: True where j <= i (j < i when strict)."""
    return torch.ones(C, C, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def causal_ones(C: int, dtype: torch.dtype, device, strict: bool = False) -> torch.Tensor:
    """[C, C] float: 1 on the causal part, 0 elsewhere (the decay matrix of an ungated op)."""
    return causal_mask(C, device, strict).to(dtype)


def segment_sums(g: torch.Tensor, chunk_axis: int = -1) -> torch.Tensor:
    """Log-decays of a chunk -> the log-decay between every pair of its tokens.

    g: [..., C] (scalar gates, chunk_axis=-1) or [..., C, K] (per-channel gates,
    chunk_axis=-2). Returns G: [..., C, C] or [..., C, C, K] with
    G[i, j] = sum_{s=j+1..i} g_s for j <= i and -inf for j > i.
    """
    axis = chunk_axis % g.dim()
    C = g.shape[axis]
    tail = (1,) * (g.dim() - 1 - axis)
    # X[s, j] = g_s where s > j, else 0; cumsum over s gives G[i, j] = sum_{j < s <= i} g_s
    x = g.unsqueeze(axis + 1).expand(g.shape[:axis + 1] + (C,) + g.shape[axis + 1:])
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    x = torch.where(causal_mask(C, g.device, strict=True).view((C, C) + tail), x, zero)
    G = x.cumsum(axis)
    neg_inf = torch.full((), float("-inf"), dtype=g.dtype, device=g.device)
    return torch.where(causal_mask(C, g.device).view((C, C) + tail), G, neg_inf)


def chunk_decays(g: torch.Tensor, chunk_axis: int = -1):
    """Everything a chunked op needs from the log-decays g of its chunks.

    g: [..., C] or [..., C, K] (see `segment_sums`). Returns
      D        [..., C, C(, K)]  exp(G): causal decay matrix (0 above the diagonal, 1 on it)
      to_start [..., C(, K)]     exp(g_1 + ... + g_i): decay from the chunk's start to token i
      to_end   [..., C(, K)]     exp(g_{j+1} + ... + g_C): decay from token j to the chunk's end
      total    [...(, K)]        exp(g_1 + ... + g_C): decay across the whole chunk
    """
    axis = chunk_axis % g.dim()
    G = segment_sums(g, chunk_axis)
    b = g.cumsum(axis)
    to_end = G.select(axis, G.shape[axis] - 1)
    total = b.select(axis, b.shape[axis] - 1)
    return G.exp(), b.exp(), to_end.exp(), total.exp()


def vector_decay_scores(q: torch.Tensor, k: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """Per-channel decayed scores for gla.

    q, k: [..., C, K]; D: [..., C, C, K] causal per-channel decays (from `chunk_decays`).
    Returns A [..., C, C]: A_ij = sum_k q_ik k_jk D_ijk (0 for j > i). Memory [..., C, C, K].
    """
    return torch.einsum("...ik,...jk,...ijk->...ij", q, k, D)
