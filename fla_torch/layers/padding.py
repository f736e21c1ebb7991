"""Padding masks for the layers (FLA's `attention_mask`: [B, T], 1 = real token, 0 = padding),
the same rules in fla_jax/layers/padding.py.

Padded tokens are neutralised, with static shapes (no unpadding):
- short convolutions see each row's real tokens only, contiguous and continuing from the conv
  cache (`masked_short_conv`): padding never enters a conv window, and the returned conv cache
  holds the last W real inputs (or the old cache entries) for left, right or inner padding;
- k and v are zeroed, the per-token log-decay is 0 (no decay) and beta is 0, so a padded token
  leaves the recurrent state unchanged (`neutralise`);
- MultiScaleRetention's rotary positions count real tokens only (`masked_positions`);
- the cache 'offset' advances by each row's number of real tokens (an int64 tensor [B]).
The layer output at padded positions is defined as 0.
"""
from __future__ import annotations

import torch

from fla_contract.layer_inputs import check_attention_mask as check_mask

from ..dtypes import dtype_name


def check_attention_mask(layer_name: str, attention_mask, hidden_states: torch.Tensor,
                         cu_seqlens=None):
    """Validate attention_mask and return it as a bool tensor [B, T] (None stays None).

    Raises ValueError for a shape other than hidden_states' [B, T], values other than 0/1, or
    attention_mask together with cu_seqlens; TypeError for a non-tensor or a non-numeric dtype."""
    if attention_mask is None:
        return None
    if cu_seqlens is not None:
        raise ValueError(f"{layer_name}: attention_mask and cu_seqlens were both given; "
                         f"expected at most one (packed sequences carry no padding)")
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{layer_name}: attention_mask is {type(attention_mask).__name__}; "
                        f"expected a torch.Tensor [B, T] of 0/1 (bool, integer or float)")
    B, T = hidden_states.shape[:2]
    dt = attention_mask.dtype
    check_mask(layer_name, tuple(attention_mask.shape), dtype_name(dt), B, T,
               tuple(hidden_states.shape))
    mask = attention_mask.to(hidden_states.device)
    if dt != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            bad = mask[(mask != 0) & (mask != 1)][0].item()
            raise ValueError(f"{layer_name}: attention_mask has the value {bad}; expected only "
                             f"0 (padding) and 1 (real token)")
        mask = mask != 0
    return mask


def masked_short_conv(conv, x: torch.Tensor, mask: torch.Tensor, cache, output_final_state: bool):
    """ShortConvolution over each row's real tokens only.

    x: [B, T, D]; mask: bool [B, T]; cache: None or [B, D, W]. The W cache entries (zeros
    without a cache) followed by the real tokens of the row are moved, in order, behind the
    padded tokens (a stable sort on the mask; static shapes) and convolved; each real token
    thus reads the previous real tokens / cache entries. Returns (y [B, T, D], zero at padded
    positions; final cache [B, D, W] = the last W of cache + real tokens, or None)."""
    B, T, D = x.shape
    W = conv.width
    if cache is None:
        prefix = x.new_zeros(B, W, D)
    else:
        if tuple(cache.shape) != (B, D, W):
            raise ValueError(f"ShortConvolution: cache has shape {list(cache.shape)}; "
                             f"expected [B, D, W] = [{B}, {D}, {W}]")
        prefix = cache.transpose(1, 2).to(x.dtype)
    keep = torch.cat([mask.new_ones(B, W), mask], dim=1)                # [B, W + T]
    xp = torch.cat([prefix, torch.where(mask[..., None], x, torch.zeros_like(x))], dim=1)
    perm = torch.argsort(keep.to(torch.int8), dim=1, stable=True)       # padding first
    xc = torch.gather(xp, 1, perm[..., None].expand(B, W + T, D))
    yc, final = conv(xc, cache=None, output_final_state=output_final_state)
    inv = torch.argsort(perm, dim=1)[:, W:]                             # [B, T]
    y = torch.gather(yc, 1, inv[..., None].expand(B, T, yc.shape[-1]))
    return torch.where(mask[..., None], y, torch.zeros_like(y)), final


def neutralise(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] with its padded tokens set to 0 (k, v; log-decays g; beta)."""
    m = mask.reshape(mask.shape + (1,) * (x.dim() - 2))
    return torch.where(m, x, torch.zeros_like(x))


def masked_positions(mask: torch.Tensor, offset) -> torch.Tensor:
    """float32 rotary positions [B, T]: offset (int or int tensor [B]) + the number of real
    tokens before t in the row (a real token's position in its unpadded sequence)."""
    before = torch.cumsum(mask.to(torch.long), dim=1) - mask.to(torch.long)
    if isinstance(offset, torch.Tensor):
        before = before + offset.to(device=mask.device, dtype=torch.long).reshape(-1, 1)
    else:
        before = before + int(offset)
    return before.to(torch.float32)


def masked_offset(offset, mask: torch.Tensor) -> torch.Tensor:
    """The cache offset after a masked call: offset + real tokens per row, int64 [B]."""
    return mask.to(torch.long).sum(1) + (offset.to(mask.device) if isinstance(offset, torch.Tensor)
                                         else int(offset))


def next_offset(offset, T: int, cu_seqlens=None, mask=None):
    """The cache offset after this call: cache.advance_offset without a mask, else
    masked_offset."""
    if mask is None:
        from .cache import advance_offset
        return advance_offset(offset, T, cu_seqlens)
    return masked_offset(offset, mask)
