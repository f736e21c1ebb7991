"""Padding masks for the layers (FLA's `attention_mask`: [B, T], 1 = real token, 0 = padding),
the same rules as fla_torch/layers/padding.py; static shapes, so everything runs under jit.

Padded tokens are neutralised (no unpadding):
- short convolutions see each row's real tokens only, contiguous and continuing from the conv
  cache (`masked_short_conv`): padding never enters a conv window, and the returned conv cache
  holds the last W real inputs (or the old cache entries) for left, right or inner padding;
- k and v are zeroed, the per-token log-decay is 0 (no decay) and beta is 0, so a padded token
  leaves the recurrent state unchanged (`neutralise`);
- MultiScaleRetention's rotary positions count real tokens only (`masked_positions`);
- the cache 'offset' advances by each row's number of real tokens (an int32 array [B]).
The layer output at padded positions is defined as 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fla_contract.layer_inputs import check_attention_mask as check_mask

from ..dtypes import dtype_name


def check_attention_mask(layer_name: str, attention_mask, hidden_states, cu_seqlens=None):
    """Validate attention_mask and return it as a bool array [B, T] (None stays None).

    Raises ValueError for a shape other than hidden_states' [B, T], values other than 0/1 (only
    checked when the mask is concrete, never under a trace), or attention_mask together with
    cu_seqlens; TypeError for a non-numeric dtype."""
    if attention_mask is None:
        return None
    if cu_seqlens is not None:
        raise ValueError(f"{layer_name}: attention_mask and cu_seqlens were both given; "
                         f"expected at most one (packed sequences carry no padding)")
    if not hasattr(attention_mask, "shape") or not hasattr(attention_mask, "dtype"):
        raise TypeError(f"{layer_name}: attention_mask is {type(attention_mask).__name__}; "
                        f"expected an array [B, T] of 0/1 (bool, integer or float)")
    B, T = hidden_states.shape[:2]
    dt = np.dtype(attention_mask.dtype)
    check_mask(layer_name, tuple(attention_mask.shape), dtype_name(dt), B, T,
               tuple(hidden_states.shape))
    if dt == np.bool_:
        return jnp.asarray(attention_mask)
    if not isinstance(attention_mask, jax.core.Tracer):
        values = np.asarray(attention_mask)
        bad = values[(values != 0) & (values != 1)]
        if bad.size:
            raise ValueError(f"{layer_name}: attention_mask has the value {bad[0]}; expected "
                             f"only 0 (padding) and 1 (real token)")
    return jnp.asarray(attention_mask) != 0


def masked_short_conv(conv, x, mask, cache, output_final_state: bool):
    """ShortConvolution over each row's real tokens only.

    x: [B, T, D]; mask: bool [B, T]; cache: None or [B, D, W]. The W cache entries (zeros
    without a cache) followed by the real tokens of the row are moved, in order, behind the
    padded tokens (a stable sort on the mask; static shapes) and convolved; each real token
    thus reads the previous real tokens / cache entries. Returns (y [B, T, D], zero at padded
    positions; final cache [B, D, W] = the last W of cache + real tokens, or None)."""
    B, T, D = x.shape
    W = conv.kernel_size
    if cache is None:
        prefix = jnp.zeros((B, W, D), x.dtype)
    else:
        if tuple(cache.shape) != (B, D, W):
            raise ValueError(f"ShortConvolution: cache has shape {list(cache.shape)}; "
                             f"expected [B, D, W] = [{B}, {D}, {W}]")
        prefix = jnp.swapaxes(cache, 1, 2).astype(x.dtype)
    keep = jnp.concatenate([jnp.ones((B, W), bool), mask], axis=1)       # [B, W + T]
    xp = jnp.concatenate([prefix, jnp.where(mask[..., None], x, jnp.zeros_like(x))], axis=1)
    perm = jnp.argsort(keep.astype(jnp.int8), axis=1, stable=True)       # padding first
    xc = jnp.take_along_axis(xp, perm[..., None], axis=1)
    yc, final = conv(xc, cache=None, output_final_state=output_final_state)
    inv = jnp.argsort(perm, axis=1)[:, W:]                               # [B, T]
    y = jnp.take_along_axis(yc, inv[..., None], axis=1)
    return jnp.where(mask[..., None], y, jnp.zeros_like(y)), final


def neutralise(mask, x):
    """x [B, T, ...] with its padded tokens set to 0 (k, v; log-decays g; beta)."""
    m = mask.reshape(mask.shape + (1,) * (x.ndim - 2))
    return jnp.where(m, x, jnp.zeros_like(x))


def masked_positions(mask, offset):
    """float32 rotary positions [B, T]: offset (int, int scalar or int array [B]) + the number
    of real tokens before t in the row (a real token's position in its unpadded sequence)."""
    m = mask.astype(jnp.int32)
    before = jnp.cumsum(m, axis=1) - m
    offset = jnp.asarray(offset).astype(jnp.int32)
    if offset.ndim == 1:
        offset = offset[:, None]
    return (before + offset).astype(jnp.float32)


def masked_offset(offset, mask):
    """The cache offset after a masked call: offset + real tokens per row, int32 [B]."""
    return jnp.sum(mask.astype(jnp.int32), axis=1) + jnp.asarray(offset).astype(jnp.int32)


def next_offset(offset, T: int, cu_seqlens=None, mask=None):
    """The cache offset after this call: cache.advance_offset without a mask, else
    masked_offset."""
    if mask is None:
        from .cache import advance_offset
        return advance_offset(offset, T, cu_seqlens)
    return masked_offset(offset, mask)
