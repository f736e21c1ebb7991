"""The Attention layer's decode cache, preallocated (mirror of fla_torch/layers/kv_cache.py;
a pytree whose structure, shapes and dtypes stay the same from one decode step to the next, so
a jitted step compiles once).

    'attn_state': (k [B, S_max, HKV, D], v [B, S_max, HKV, D]) in the compute dtype, rotary
                  applied to k; slots [0, length) hold every key / value so far, later slots
                  are unwritten (zeros)
    'attn_mask':  bool [B, S_max]: True = a written slot of a real token (False = unwritten, or
                  a padded token's slot)
    'length':     int (an int32 scalar under jit): slots written, the same for every row
    'offset':     as layers/cache.py (rotary positions continue from it)

Capacity S_max is fixed when the cache is created (the call with use_cache=True and no
past_key_values): `max_cache_len` if given, else the prompt's T + KV_CACHE_BLOCK rounded up
to a multiple of KV_CACHE_BLOCK. A call writes its T keys / values at slot `length`
(lax.dynamic_update_slice) and attends slots [0, length + T) under the causal / window rule
(query t at slot length + t). A call that does not fit (length + T > S_max) raises ValueError
when the length is concrete (eager); under jit the length is traced, so such a step returns
NaN outputs (and every later step does too): size max_cache_len for the whole generation.
A model's list of per-layer caches mixes these with the linear-attention layers' dicts; it
has no 'recurrent_state', so a linear layer handed it by mistake raises the cache error of
fla_contract.layer_inputs, and `check_kv_cache` names the mistake the other way round.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fla_contract import layer_inputs as contract
from fla_contract.kv_cache import KV_CACHE_BLOCK, check_fits, creation_capacity

__all__ = ["KV_CACHE_BLOCK", "check_kv_cache", "read_kv_cache", "new_kv_cache", "write_kv",
           "overflowed"]


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
    entries = [("past_key_values['attn_state'][0] (k)", tuple(k.shape), want,
                "[B, S_max, num_kv_heads, head_dim]"),
               ("past_key_values['attn_state'][1] (v)", tuple(v.shape), want,
                "[B, S_max, num_kv_heads, head_dim]"),
               ("past_key_values['attn_mask']", tuple(jnp.shape(cache["attn_mask"])), (B, S),
                "[B, S_max]"),
               ("past_key_values['length']", tuple(jnp.shape(cache["length"])), (), "[]")]
    offset = cache.get("offset", 0)
    if getattr(offset, "ndim", 0) > 0:
        entries.append(("past_key_values['offset']", tuple(offset.shape), (B,), "[B]"))
    contract.check_cache_shapes(name, entries)


def read_kv_cache(cache):
    """A checked cache -> (k, v, mask, length, offset)."""
    k, v = cache["attn_state"]
    return k, v, cache["attn_mask"], cache["length"], cache.get("offset", 0)


def new_kv_cache(name: str, k, v, mask, offset, T: int, max_cache_len) -> dict:
    """The cache after a first call: its k, v [B, T, HKV, D] (mask bool [B, T] or None) in
    slots [0, T) of zeroed buffers of the creation capacity."""
    B = k.shape[0]
    S = creation_capacity(name, T, max_cache_len)
    kb = jnp.zeros((B, S) + k.shape[2:], k.dtype).at[:, :T].set(k)
    vb = jnp.zeros((B, S) + v.shape[2:], v.dtype).at[:, :T].set(v)
    valid = jnp.ones((B, T), bool) if mask is None else mask
    mb = jnp.zeros((B, S), bool).at[:, :T].set(valid)
    return {"attn_state": (kb, vb), "attn_mask": mb, "length": T, "offset": offset}


def write_kv(name: str, cache, k, v, mask):
    """Write this call's k, v [B, T, HKV, D] (mask bool [B, T] or None) at slot `length`.

    Returns (k_buf, v_buf, mask_buf, length, new length). Raises ValueError when the length
    is concrete and the call does not fit; under a trace see `overflowed`."""
    kb, vb, mb, L, _ = read_kv_cache(cache)
    B, T = k.shape[:2]
    if not isinstance(L, jax.core.Tracer):
        L = int(L)
        check_fits(name, L, T, kb.shape[1])
    valid = jnp.ones((B, T), bool) if mask is None else mask
    zero = jnp.zeros((), jnp.int32)
    at = jnp.asarray(L, jnp.int32)
    kb = jax.lax.dynamic_update_slice(kb.astype(k.dtype), k, (zero, at, zero, zero))
    vb = jax.lax.dynamic_update_slice(vb.astype(v.dtype), v, (zero, at, zero, zero))
    mb = jax.lax.dynamic_update_slice(mb, valid, (zero, at))
    return kb, vb, mb, L, L + T


def overflowed(L, T: int, S: int):
    """None when L is concrete (write_kv has checked it), else a traced bool: L + T > S."""
    return None if not isinstance(L, jax.core.Tracer) else (L + T > S)
