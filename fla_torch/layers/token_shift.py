"""RWKV token shift: each token sees the previous token of its own sequence (mirror:
fla_jax/layers/token_shift.py).

The shift state (cache) is the last token's input [N, D] (FLA's token-shift cache), in the
compute dtype. With a padding mask the previous token is the previous real token of the row
(padding is skipped; a row without real tokens before t reads the cache); with cu_seqlens
(B == 1) a sequence starts from its cache row (or zeros), never from the sequence before.
"""
from __future__ import annotations

import torch

from ..modules.varlen import token_sequence


def token_shift(x: torch.Tensor, cache=None, mask=None, cu_seqlens=None):
    """x [B, T, D] -> (prev [B, T, D] the previous token's x, last [N, D] the new cache).

    cache: None (zeros) or [N, D]; N = B, or len(cu_seqlens) - 1 with cu_seqlens.
    mask: None or bool [B, T] (1 = real token)."""
    B, T, D = x.shape
    if cu_seqlens is not None:
        return _shift_varlen(x, cache, cu_seqlens)
    before = x.new_zeros(B, D) if cache is None else cache.to(x.dtype)
    if mask is None:
        prev = torch.cat([before[:, None], x[:, :-1]], dim=1)
        return prev, x[:, -1]
    t = torch.arange(T, device=x.device)
    pos = torch.where(mask, t, torch.full_like(t, -1).expand(B, T))
    last_real = torch.cummax(pos, dim=1).values                          # [B, T]
    prev_idx = torch.cat([last_real.new_full((B, 1), -1), last_real[:, :-1]], dim=1)
    gathered = torch.gather(x, 1, prev_idx.clamp(min=0)[..., None].expand(B, T, D))
    prev = torch.where((prev_idx >= 0)[..., None], gathered, before[:, None])
    end = last_real[:, -1]
    last = torch.where((end >= 0)[:, None], x[torch.arange(B, device=x.device), end.clamp(min=0)],
                       before)
    return prev, last


def _shift_varlen(x, cache, cu_seqlens):
    """x [1, T, D] packed; cache None or [N, D]."""
    _, T, D = x.shape
    N = cu_seqlens.numel() - 1
    before = x.new_zeros(N, D) if cache is None else cache.to(x.dtype)
    seq, start = token_sequence(cu_seqlens, T)
    t = torch.arange(T, device=x.device)
    inside = x[0, (t - 1).clamp(min=0)]
    prev = torch.where((t > start)[:, None], inside, before[seq])[None]
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    last = torch.where((cu[1:] > cu[:-1])[:, None], x[0, (cu[1:] - 1).clamp(min=0)], before)
    return prev, last
