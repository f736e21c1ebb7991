"""The Attention layer's decode cache (mirror of fla_torch/layers/kv_cache.py; a pytree).

    'attn_state': (k [B, S, HKV, D], v [B, S, HKV, D]) in the compute dtype, rotary applied
                  to k -- every key and value so far (S grows by T per call)
    'attn_mask':  bool [B, S] (False = a padded slot), or None when no call had padding
    'offset':     as layers/cache.py (rotary positions continue from it)
'recurrent_state' and 'conv_state' are None, so a model's list of per-layer caches mixes
attention and linear-attention layers freely. S grows, so a jitted decode step retraces
once per length.
"""
from __future__ import annotations

import jax.numpy as jnp


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


def extend(old, new, axis: int = 1):
    """old (or None) followed by new along `axis`."""
    return new if old is None else jnp.concatenate([old.astype(new.dtype), new], axis=axis)


def extend_mask(old_mask, S_old: int, mask, B: int, T: int):
    """The key mask [B, S_old + T] after this call, or None when neither part has padding."""
    if old_mask is None and mask is None:
        return None
    if old_mask is None:
        old_mask = jnp.ones((B, S_old), bool)
    if mask is None:
        mask = jnp.ones((B, T), bool)
    return jnp.concatenate([old_mask, mask], axis=1)


def make_kv_cache(k, v, mask, offset) -> dict:
    return {"recurrent_state": None, "conv_state": None, "offset": offset, "attn_state": (k, v),
            "attn_mask": mask}
