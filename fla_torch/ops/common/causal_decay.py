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


def segment_sums(g: torch.Tensor) -> torch.Tensor:
    """Log-decays of a chunk -> the log-decay between every pair of its tokens.

    g: [..., C] (per-channel gates: put the channel axis before the chunk axis, [..., K, C]).
    Returns G: [..., C, C] with G[i, j] = sum_{s=j+1..i} g_s for j <= i and -inf for j > i.
    """
    C = g.shape[-1]
    # X[j, s] = g_s where s > j, else 0; a cumsum over s (the last, contiguous axis) gives
    # Z[j, i] = sum_{j < s <= i} g_s = G[i, j]
    x = g.unsqueeze(-2) * causal_ones(C, g.dtype, g.device, strict=True).T
    G = x.cumsum(-1).transpose(-1, -2)
    bias = torch.zeros(C, C, dtype=g.dtype, device=g.device).masked_fill(
        ~causal_mask(C, g.device), float("-inf"))
    return G + bias


def chunk_decays(g: torch.Tensor):
    """Everything a chunked op needs from the log-decays g of its chunks.

    g: [..., C] (per-channel gates as [..., K, C]). Returns
      D        [..., C, C]  exp(G): causal decay matrix (0 above the diagonal, 1 on it)
      to_start [..., C]     exp(g_1 + ... + g_i): decay from the chunk's start to token i
      to_end   [..., C]     exp(g_{j+1} + ... + g_C): decay from token j to the chunk's end
      total    [...]        exp(g_1 + ... + g_C): decay across the whole chunk
    """
    G = segment_sums(g)
    b = g.cumsum(-1)
    return G.exp(), b.exp(), G[..., -1, :].exp(), b[..., -1].exp()


def vector_decay_scores(q: torch.Tensor, k: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """Per-channel decayed scores for gla.

    q, k: [..., C, K]; D: [..., K, C, C] causal per-channel decays (`chunk_decays` of the
    gates laid out [..., K, C]). Returns A [..., C, C]: A_ij = sum_k q_ik k_jk D_kij
    (0 for j > i). Memory [..., K, C, C]: keep C small.
    """
    qt, kt = q.transpose(-1, -2), k.transpose(-1, -2)                 # [..., K, C]
    return (qt[..., :, None] * kt[..., None, :] * D).sum(-3)
