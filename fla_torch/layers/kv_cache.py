"""The Attention layer's decode cache, preallocated: the per-layer cache dict of
layers/cache.py with its keys and values added (the same dict in fla_jax/layers/kv_cache.py).

    'attn_state': (k [B, S_max, HKV, D], v [B, S_max, HKV, D]) in the compute dtype, rotary
                  applied to k; slots [0, length) hold every key / value so far, later slots
                  are unwritten (zeros)
    'attn_mask':  bool [B, S_max]: True = a written slot of a real token (False = unwritten, or
                  a padded token's slot)
    'length':     int: slots written, the same for every row
    'offset':     as layers/cache.py (rotary positions continue from it)

Capacity S_max is fixed when the cache is created (the call with use_cache=True and no
past_key_values): `max_cache_len` if given, else the prompt's T + KV_CACHE_BLOCK rounded up
to a multiple of KV_CACHE_BLOCK (fla_contract/kv_cache.py). A call writes its T keys / values
at slot `length` into copies of the buffers (the cache passed in is never modified, so a
cache can be reused, as in jax) and attends slots [0, length + T). A call that does not fit
raises ValueError. A model's list of per-layer caches mixes these with the linear-attention
layers' dicts; it has no 'recurrent_state', so a linear layer handed it by mistake raises the
cache error of fla_contract.layer_inputs, and `check_kv_cache` names the mistake the other way
round.
"""
from __future__ import annotations

import torch

from fla_contract import layer_inputs as contract
from fla_contract.kv_cache import KV_CACHE_BLOCK, check_fits, creation_capacity

__all__ = ["KV_CACHE_BLOCK", "check_kv_cache", "read_kv_cache", "new_kv_cache", "write_kv"]


def check_kv_cache(layer, name: str, cache, B: int) -> None:
    """past_key_values must be the dict this layer returned: k, v [B, S_max, num_kv_heads,
    head_dim], attn_mask [B, S_max], length, offset int or [B]. Raises TypeError / ValueError
    with the words of fla_contract.layer_inputs."""
    if not isinstance(cache, dict) or "attn_state" not in cache or "length" not in cache:
        what = type(cache).__name__ + (" without 'attn_state' and 'length' (a linear-attention "
                                       "layer's cache?)" if isinstance(cache, dict) else "")
        raise TypeError(f"{name}: past_key_values is {what}; expected the per-layer cache dict "
                        f"this layer returned with use_cache=True (keys attn_state, attn_mask, "
                        f"length, offset)")
    k, v = cache["attn_state"]
    S = k.shape[1] if len(k.shape) == 4 else -1
    want = (B, S, layer.num_kv_heads, layer.head_dim)
    length = cache["length"]
    entries = [("past_key_values['attn_state'][0] (k)", tuple(k.shape), want,
                "[B, S_max, num_kv_heads, head_dim]"),
               ("past_key_values['attn_state'][1] (v)", tuple(v.shape), want,
                "[B, S_max, num_kv_heads, head_dim]"),
               ("past_key_values['attn_mask']", tuple(cache["attn_mask"].shape), (B, S),
                "[B, S_max]"),
               ("past_key_values['length']", tuple(getattr(length, "shape", ())), (), "[]")]
    offset = cache.get("offset", 0)
    if getattr(offset, "ndim", 0) > 0:
        entries.append(("past_key_values['offset']", tuple(offset.shape), (B,), "[B]"))
    contract.check_cache_shapes(name, entries)


def read_kv_cache(cache):
    """A checked cache -> (k, v, mask, length (int), offset)."""
    k, v = cache["attn_state"]
    return k, v, cache["attn_mask"], int(cache["length"]), cache.get("offset", 0)


def new_kv_cache(name: str, k, v, mask, offset, T: int, max_cache_len) -> dict:
    """The cache after a first call: its k, v [B, T, HKV, D] (mask bool [B, T] or None) in
    slots [0, T) of zeroed buffers of the creation capacity."""
    B = k.shape[0]
    S = creation_capacity(name, T, max_cache_len)
    kb = k.new_zeros((B, S) + tuple(k.shape[2:]))
    vb = v.new_zeros((B, S) + tuple(v.shape[2:]))
    mb = torch.zeros(B, S, dtype=torch.bool, device=k.device)
    kb[:, :T], vb[:, :T] = k, v
    mb[:, :T] = True if mask is None else mask
    return {"attn_state": (kb, vb), "attn_mask": mb, "length": T, "offset": offset}


def write_kv(name: str, cache, k, v, mask):
    """Write this call's k, v [B, T, HKV, D] (mask bool [B, T] or None) at slot `length` of
    copies of the buffers. Returns (k_buf, v_buf, mask_buf, length, new length); raises
    ValueError when the call does not fit."""
    kb, vb, mb, L, _ = read_kv_cache(cache)
    T = k.shape[1]
    check_fits(name, L, T, kb.shape[1])
    kb, vb, mb = kb.to(k.dtype, copy=True), vb.to(v.dtype, copy=True), mb.to(k.device, copy=True)
    kb[:, L:L + T], vb[:, L:L + T] = k, v
    mb[:, L:L + T] = True if mask is None else mask
    return kb, vb, mb, L, L + T
