"""The Attention layer's decode cache: the per-layer cache dict of layers/cache.py with its
keys and values added (the same dict in fla_jax/layers/kv_cache.py).

    'attn_state': (k [B, S, HKV, D], v [B, S, HKV, D]) in the compute dtype, rotary applied
                  to k -- every key and value so far (S grows by T per call)
    'attn_mask':  bool [B, S] (False = a padded slot), or None when no call had padding
    'offset':     as layers/cache.py (rotary positions continue from it)
A model's list of per-layer caches mixes these with the linear-attention layers' dicts; it
has no 'recurrent_state', so a linear layer handed it by mistake raises the cache error of
fla_contract.layer_inputs, and `check_kv_cache` names the mistake the other way round.
"""
from __future__ import annotations

import torch

from fla_contract import layer_inputs as contract


def check_kv_cache(layer, name: str, cache, B: int) -> None:
    """past_key_values must be the dict this layer returned: k, v [B, S, num_kv_heads,
    head_dim], attn_mask None or [B, S], offset int or [B]. Raises TypeError / ValueError with
    the words of fla_contract.layer_inputs."""
    if not isinstance(cache, dict) or "attn_state" not in cache:
        what = type(cache).__name__ + (" without 'attn_state' (a linear-attention layer's "
                                       "cache?)" if isinstance(cache, dict) else "")
        raise TypeError(f"{name}: past_key_values is {what}; expected the per-layer cache dict "
                        f"this layer returned with use_cache=True (keys attn_state, attn_mask, "
                        f"offset)")
    k, v = cache["attn_state"]
    S = k.shape[1] if len(k.shape) == 4 else -1
    want = (B, S, layer.num_kv_heads, layer.head_dim)
    entries = [("past_key_values['attn_state'][0] (k)", tuple(k.shape), want,
                "[B, S, num_kv_heads, head_dim]"),
               ("past_key_values['attn_state'][1] (v)", tuple(v.shape), want,
                "[B, S, num_kv_heads, head_dim]")]
    if cache.get("attn_mask") is not None:
        entries.append(("past_key_values['attn_mask']", tuple(cache["attn_mask"].shape), (B, S),
                        "[B, S]"))
    offset = cache.get("offset", 0)
    if getattr(offset, "ndim", 0) > 0:
        entries.append(("past_key_values['offset']", tuple(offset.shape), (B,), "[B]"))
    contract.check_cache_shapes(name, entries)


def read_kv_cache(cache):
    """None -> (None, None, None, 0); else (k, v, mask or None, offset) of a checked cache."""
    if cache is None:
        return None, None, None, 0
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
    return {"attn_state": (k, v), "attn_mask": mask, "offset": offset}
