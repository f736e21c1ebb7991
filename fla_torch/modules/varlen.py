"""Index helpers for packed sequences (cu_seqlens [N+1], B == 1), shared by the modules."""
from __future__ import annotations

import torch


def token_sequence(cu_seqlens: torch.Tensor, T: int):
    """For each packed position t in [0, T): (sequence index [T], sequence start [T])."""
    cu = cu_seqlens.to(torch.long)
    t = torch.arange(T, device=cu.device)
    seq = torch.searchsorted(cu[1:], t, right=True).clamp(max=cu.numel() - 2)
    return seq, cu[seq]
