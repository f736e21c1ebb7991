"""The per-layer decode cache, the same dict in fla_torch and fla_jax.

A layer called with `use_cache=True` returns, as the third item of its output, a dict:

    'recurrent_state': [B, HV, K, V] float32 -- the linear-attention state after the last token
                       (GatedSlotAttention: the tuple (hk [B, H, K, M], hv [B, H, M, V]))
    'conv_state':      (q, k, v) ShortConvolution caches, each [B, D, W] in the compute dtype
                       (the last W projected inputs, newest last), or None without short convs
    'offset':          int -- number of tokens consumed so far (positions, e.g. for rotary);
                       an int64 tensor [N] (tokens per sequence) after a packed (cu_seqlens) call
                       or [B] (real tokens per row) after a call with attention_mask
    'k_sum':           [B, H, K] float32 -- LinearAttention with do_feature_map_norm only
    'shift_state':     [B, hidden] -- RWKV7Attention only: the last token's input (token
                       shift), in the compute dtype; its conv_state is None

Pass it back as `past_key_values=` to continue: the output of a prefill of T tokens followed by
token-by-token decoding equals one forward over the whole sequence. A model keeps one such
dict per layer (a list indexed by layer), replacing each with the dict the layer returns.
"""
from __future__ import annotations

import torch

from fla_contract.layer_inputs import check_cache_structure

CACHE_KEYS = ("recurrent_state", "conv_state", "offset", "k_sum")


def read_cache(layer_name: str, cache, use_short_conv: bool):
    """Check a cache dict; return (recurrent_state, (conv_q, conv_k, conv_v), offset).

    None -> (None, (None, None, None), 0)."""
    if cache is None:
        return None, (None, None, None), 0
    conv = cache.get("conv_state") if isinstance(cache, dict) else None
    check_cache_structure(layer_name, type(cache).__name__,
                          list(cache) if isinstance(cache, dict) else [], use_short_conv,
                          None if conv is None else (len(conv) if hasattr(conv, "__len__") else -1),
                          False)
    conv = tuple(conv) if use_short_conv else (None, None, None)
    state = cache["recurrent_state"]
    for part in (state if isinstance(state, tuple) else (state,)):   # GSA: (hk, hv)
        if part is not None and part.dtype != torch.float32:
            raise TypeError(f"{layer_name}: past_key_values['recurrent_state'] has dtype "
                            f"{part.dtype}; expected torch.float32 (recurrent states are "
                            f"float32)")
    return state, conv, cache.get("offset", 0)


def make_cache(recurrent_state, conv_state, offset: int, **extra) -> dict:
    cache = {"recurrent_state": recurrent_state, "conv_state": conv_state, "offset": offset}
    cache.update(extra)
    return cache


def advance_offset(offset, T: int, cu_seqlens=None):
    """offset after T more tokens; with cu_seqlens, per sequence: offset + lengths [N]."""
    if cu_seqlens is None:
        return offset + T
    cu = cu_seqlens.to(torch.long)
    return offset + (cu[1:] - cu[:-1])
