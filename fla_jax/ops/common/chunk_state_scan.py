"""The sequential part of every chunked op: pass the [K, V] state from chunk to chunk.

Per chunk (all tensors of one lane and value head; C tokens):
    S_in  = reset ? reset_state : S          (varlen: a chunk that starts a sequence)
    U     = X - W S_in                        (W is None for gated linear attention: U = X)
    S_out = diag(a) S_in + Kd^T U             a: [K] decay over the whole chunk
Gated linear attention: X = v, Kd = k * exp(b_C - b). Delta rule (WY/UT form): X = the
pseudo-values T (beta v), W = T (beta exp(b) k). The scan returns the states entering every
chunk, from which all outputs follow in parallel.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .compute_operands import einsum


def _vma(x) -> frozenset:
    """The mesh axes x varies over inside shard_map (jax 0.10: manual_axis_type.varying;
    earlier: vma); empty outside shard_map or on a jax without these types."""
    t = jax.typeof(x)
    if hasattr(t, "manual_axis_type"):
        return frozenset(t.manual_axis_type.varying)
    return frozenset(getattr(t, "vma", ()))


def _varying_like(carry, xs):
    """carry marked varying over every mesh axis some scanned input varies over (inside
    shard_map with check_vma, a scan's carry must keep its type); unchanged outside."""
    vma = frozenset().union(*(_vma(t) for t in jax.tree_util.tree_leaves(xs)))
    missing = tuple(sorted(vma - _vma(carry)))
    if not missing:
        return carry
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(carry, missing, to="varying")
    return jax.lax.pvary(carry, missing)


def scan_chunk_states(chunk_decay, k_decayed, x, w, carry0, reset=None,
                      reset_states: Optional[jnp.ndarray] = None, collect_after=False):
    """chunk_decay: [B, NC, HV, K] (exp of the chunk's total log-decay; K may be 1);
    k_decayed: [B, NC, HV, C, K]; x: [B, NC, HV, C, V]; w: None or [B, NC, HV, C, K];
    carry0: [B, HV, K, V]; reset: None or [NC] bool (varlen, B == 1); reset_states: None
    (reset to 0) or [NC, HV, K, V].
    Returns (S_in [B, NC, HV, K, V], S_after [NC, B, HV, K, V] or None, S_last [B, HV, K, V])."""
    cm = lambda t: None if t is None else jnp.moveaxis(t, 1, 0)  # chunk-major
    xs = {"a": cm(chunk_decay), "kd": cm(k_decayed), "x": cm(x), "w": cm(w)}
    if reset is not None:
        xs["reset"] = reset
        if reset_states is not None:
            xs["h0"] = reset_states

    def body(S, c):
        if "reset" in c:
            fresh = c["h0"][None] if "h0" in c else jnp.zeros_like(S)
            S = jnp.where(c["reset"], fresh, S)
        u = c["x"] if c["w"] is None else c["x"] - einsum("bhck,bhkv->bhcv", c["w"], S)
        S_out = c["a"][..., None] * S + einsum("bhck,bhcv->bhkv", c["kd"], u)
        return S_out, ((S, S_out) if collect_after else (S, None))

    S_last, (S_in, S_after) = jax.lax.scan(body, _varying_like(carry0, xs), xs)
    return jnp.moveaxis(S_in, 0, 1), S_after, S_last
