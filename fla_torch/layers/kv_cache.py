"""The Attention layer's decode cache: the per-layer cache dict of layers/cache.py with its
keys and values added (the same dict in fla_jax/layers/kv_cache.py).

    'attn_state': (k [B, S, HKV, D], v [B, S, HKV, D]) in the compute dtype, rotary applied
                  to k -- every key and value so far (S grows by T per call)
    'attn_mask':  bool [B, S] (False = a padded slot), or None when no call had padding
    'offset':     as layers/cache.py (rotary positions continue from it)
'recurrent_state' and 'conv_state' are None, so a model's list of per-layer caches mixes
attention and linear-attention layers freely.
"""
from __future__ import annotations

import torch


def read_kv_cache(layer_name: str, cache):
    """None -> (None, None, None, 0); else (k, v, mask or None, offset) after checks."""
    if cache is None:
        return None, None, None, 0
    if not isinstance(cache, dict) or "attn_state" not in cache:
        raise TypeError(f"{layer_name}: past_key_values is {type(cache).__name__}"
                        f"{' without attn_state' if isinstance(cache, dict) else ''}; expected "
                        f"the cache dict this layer returned with use_cache=True (keys "
                        f"attn_state, attn_mask, offset)")
    k, v = cache["attn_state"]
    return k, v, cache.get("attn_mask"), cache.get("offset", 0)


def extend(old, new, dim: int = 1):
    """old (or None) followed by new along `dim`."""
    return new if old is None else torch.cat([old.to(new.dtype), new], dim=dim)


def extend_mask(old_mask, S_old: int, mask, B: int, T: int, device):
    """The key mask [B, S_old + T] after this call, or None when neither part has padding."""
    if old_mask is None and mask is None:
        return None
    if old_mask is None:
        old_mask = torch.ones(B, S_old, dtype=torch.bool, device=device)
    if mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=device)
    return torch.cat([old_mask.to(device), mask], dim=1)


def make_kv_cache(k, v, mask, offset) -> dict:
    return {"recurrent_state": None, "conv_state": None, "offset": offset, "attn_state": (k, v),
            "attn_mask": mask}
