"""The Attention layer's preallocated KV cache: its capacity rule and its errors, the same in
both frameworks (fla_jax/layers/kv_cache.py, fla_torch/layers/kv_cache.py).

Capacity S_max (slots) is fixed when a cache is created: `max_cache_len` when given (>= the
creating call's T), else T + KV_CACHE_BLOCK rounded up to a multiple of KV_CACHE_BLOCK (room
for at least KV_CACHE_BLOCK decode steps; a jitted prefill retraces only when T crosses a
multiple of the block). It never grows: a call with length + T > S_max is refused.
"""
from __future__ import annotations

import numbers

KV_CACHE_BLOCK = 256


def creation_capacity(layer: str, T: int, max_cache_len) -> int:
    """S_max of a cache created by a call of T tokens."""
    if max_cache_len is None:
        return -(-(T + KV_CACHE_BLOCK) // KV_CACHE_BLOCK) * KV_CACHE_BLOCK
    if not isinstance(max_cache_len, numbers.Integral) or isinstance(max_cache_len, bool):
        raise TypeError(f"{layer}: max_cache_len is {type(max_cache_len).__name__} "
                        f"{max_cache_len!r}; expected None or an int >= T (cache capacity in "
                        f"tokens)")
    if max_cache_len < T:
        raise ValueError(f"{layer}: max_cache_len={max_cache_len} is smaller than the T={T} "
                         f"tokens of the call that creates the cache; expected max_cache_len "
                         f">= T (prompt + new tokens)")
    return int(max_cache_len)


def check_fits(layer: str, length: int, T: int, capacity: int) -> None:
    """A call of T tokens on a cache holding `length` of `capacity` slots."""
    if length + T > capacity:
        raise ValueError(f"{layer}: KV cache full: past_key_values holds {length} of "
                         f"{capacity} slots (its max_cache_len) and this call adds T={T}; "
                         f"expected length + T <= {capacity}: create the cache with a larger "
                         f"max_cache_len (prompt + all new tokens)")


def check_max_cache_len_use(layer: str, max_cache_len, use_cache: bool, capacity) -> None:
    """max_cache_len sizes a new cache: it needs use_cache=True, and with past_key_values it
    must equal that cache's capacity (capacity None: no past cache)."""
    if max_cache_len is None:
        return
    if not use_cache:
        raise ValueError(f"{layer}: max_cache_len={max_cache_len} with use_cache=False; "
                         f"expected max_cache_len only when a cache is returned")
    if capacity is not None and max_cache_len != capacity:
        raise ValueError(f"{layer}: max_cache_len={max_cache_len} but past_key_values has "
                         f"capacity {capacity}; a cache's capacity is fixed when it is created "
                         f"(pass the same value, or None)")
