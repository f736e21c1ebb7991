"""Rotary position embedding without parameters (FLA's RotaryEmbedding defaults: base 10000,
rotate-half / GPT-NeoX layout, positions in float32), as MultiScaleRetention uses it."""
from __future__ import annotations

import torch

from ..modules.precision import no_autocast


def rotary_positions(B: int, T: int, offset, cu_seqlens=None, device=None) -> torch.Tensor:
    """float32 positions [B, T]. offset: int, or an integer tensor [B] (or [N] with cu_seqlens)
    of tokens already consumed per row / sequence. With cu_seqlens (B == 1) positions restart
    at each sequence start."""
    t = torch.arange(T, device=device)
    if cu_seqlens is not None:
        from ..modules.varlen import token_sequence
        seq, start = token_sequence(cu_seqlens.to(device), T)
        pos = (t - start).float()
        if isinstance(offset, torch.Tensor) and offset.dim() == 1:
            pos = pos + offset.to(device)[seq].float()
        else:
            pos = pos + float(offset)
        return pos[None].expand(B, T)
    if isinstance(offset, torch.Tensor) and offset.dim() == 1:
        return offset.to(device)[:, None].float() + t[None].float()
    return (t.float() + float(offset))[None].expand(B, T)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x: [B, T, H, D] (D even) at float32 positions [B, T] -> same shape and dtype, computed
    in float32 (rotate-half layout)."""
    B, T, H, D = x.shape
    if D % 2 != 0:
        raise ValueError(f"rotary: head size D={D}; expected an even size")
    with no_autocast(x):
        inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32,
                                                device=x.device) / D))
        freqs = positions[..., None] * inv_freq                  # [B, T, D/2]
        cos, sin = freqs.cos()[:, :, None, :], freqs.sin()[:, :, None, :]
        xf = x.float()
        x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def retention_log_decay(num_heads: int, device=None) -> torch.Tensor:
    """RetNet's fixed per-head log-decay [H], float32: log(1 - 2 ** (-5 - h))."""
    h = torch.arange(num_heads, dtype=torch.float32, device=device)
    return torch.log1p(-torch.pow(2.0, -5.0 - h))
