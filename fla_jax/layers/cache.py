"""The per-layer decode cache, the same dict in fla_jax and fla_torch (a pytree, so it passes
through jax.jit).

A layer called with `use_cache=True` returns, as the third item of its output, a dict:

    'recurrent_state': [B, HV, K, V] float32 -- the linear-attention state after the last token
                       (GatedSlotAttention: the tuple (hk [B, H, K, M], hv [B, H, M, V]))
    'conv_state':      (q, k, v) ShortConvolution caches, each [B, D, W] in the compute dtype
                       (the last W projected inputs, newest last), or None without short convs
    'offset':          int (or an int32 scalar under jit) -- tokens consumed so far; an int
                       array [N] (tokens per sequence) after a packed (cu_seqlens) call
                       or [B] (real tokens per row) after a call with attention_mask
    'k_sum':           [B, H, K] float32 -- LinearAttention with do_feature_map_norm only
    'shift_state':     [B, hidden] -- RWKV7Attention only: the last token's input (token
                       shift), in the compute dtype; its conv_state is None

Pass it back as `past_key_values=` to continue: a prefill followed by token-by-token decoding
equals one forward over the whole sequence. A model keeps one such dict per layer.
"""
from __future__ import annotations

import numpy as np

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
        if part is not None and np.dtype(part.dtype) != np.dtype(np.float32):
            raise TypeError(f"{layer_name}: past_key_values['recurrent_state'] has dtype "
                            f"{np.dtype(part.dtype).name}; expected float32 (recurrent states "
                            f"are float32)")
    return state, conv, cache.get("offset", 0)


def make_cache(recurrent_state, conv_state, offset, **extra) -> dict:
    cache = {"recurrent_state": recurrent_state, "conv_state": conv_state, "offset": offset}
    cache.update(extra)
    return cache


def advance_offset(offset, T: int, cu_seqlens=None):
    """offset after T more tokens; with cu_seqlens, per sequence: offset + lengths [N]."""
    if cu_seqlens is None:
        return offset + T
    return offset + (cu_seqlens[1:] - cu_seqlens[:-1])
