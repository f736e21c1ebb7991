"""Rotary position embedding without parameters (FLA's RotaryEmbedding defaults: base 10000,
rotate-half / GPT-NeoX layout, positions in float32), as MultiScaleRetention uses it."""
from __future__ import annotations

import torch

from ..modules.precision import no_autocast


def apply_rotary(x: torch.Tensor, offset: int, base: float = 10000.0) -> torch.Tensor:
    """x: [B, T, H, D] (D even) at positions offset .. offset + T - 1 -> same shape and dtype.
    Computed in float32."""
    B, T, H, D = x.shape
    if D % 2 != 0:
        raise ValueError(f"rotary: head size D={D}; expected an even size")
    with no_autocast(x):
        inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32,
                                                device=x.device) / D))
        pos = torch.arange(T, dtype=torch.float32, device=x.device) + float(offset)
        freqs = pos[:, None] * inv_freq[None, :]                 # [T, D/2]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        xf = x.float()
        x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def retention_log_decay(num_heads: int, device=None) -> torch.Tensor:
    """RetNet's fixed per-head log-decay [H], float32: log(1 - 2 ** (-5 - h))."""
    h = torch.arange(num_heads, dtype=torch.float32, device=device)
    return torch.log1p(-torch.pow(2.0, -5.0 - h))
