"""GSA's operands in the compute dtype: the slot write weights and log-decays (FLA's additive
gate when g is None) and the key/value heads expanded to the query heads.

Shared by gsa/reference.py and gsa/chunked.py (cu_seqlens may be traced).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common.compute_operands import compute_dtype, expand_heads
from ..common.token_recurrence import token_sequence_ids


def sequence_starts(T: int, cu_seqlens):
    """[T] bool: True where a sequence starts (token 0 without cu_seqlens)."""
    if cu_seqlens is None:
        return jnp.arange(T) == 0
    return token_sequence_ids(cu_seqlens, T)[1]


def slot_gate(s, cu_seqlens=None):
    """s: [B, T, H, M] slot logits (compute dtype). Per sequence and slot, with
    z_t = logsumexp(s_1..s_t): returns (w = exp(s - z), g = z_{t-1} - z_t, 0 at a sequence's
    first token), both [B, T, H, M]."""
    starts = sequence_starts(s.shape[1], cu_seqlens)[None, :, None, None]
    flags = jnp.broadcast_to(starts, s.shape)

    def combine(a, b):
        (fa, za), (fb, zb) = a, b
        return fa | fb, jnp.where(fb, zb, jnp.logaddexp(za, zb))

    _, z = jax.lax.associative_scan(combine, (flags, s), axis=1)
    z_prev = jnp.concatenate([z[:, :1], z[:, :-1]], axis=1)
    return jnp.exp(s - z), jnp.where(flags, jnp.zeros((), s.dtype), z_prev - z)


def gsa_operands(q, k, v, s, g, initial_state, cu_seqlens):
    """Cast to the compute dtype (fp32, fp64 for fp64 q), derive (s, g) when g is None, and
    expand k, v, s, g [B, T, H, *] and the state parts [N, H, *] to q's HQ heads.

    Returns (q, k, v, s, g, hk0, hv0, NG) with NG = HQ // H."""
    cd = compute_dtype(q)
    q, k, v, s = (x.astype(cd) for x in (q, k, v, s))
    if g is None:
        s, g = slot_gate(s, cu_seqlens)
    else:
        g = g.astype(cd)
    HQ, H = q.shape[2], k.shape[2]
    NG = HQ // H
    k, v, s, g = (expand_heads(x, HQ) for x in (k, v, s, g))
    hk0, hv0 = initial_state if initial_state is not None else (None, None)
    hk0, hv0 = (None if h is None else jnp.repeat(h.astype(cd), NG, axis=1) for h in (hk0, hv0))
    return q, k, v, s, g, hk0, hv0, NG


def group_final(state, NG: int):
    """[N, HQ, ...] -> [N, H, ...]: the state of each key/value head (the same for every query
    head of its group)."""
    return state if NG == 1 else state[:, ::NG]


def kernel_call(run, q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens):
    """A GSA Pallas kernel's host side (the mirror of fla_torch's gsa/slot_inputs.kernel_call):
    the slot weights (FLA's additive gate when g is None, formed in fp32, weights rounded to
    q's dtype), k, v, s, g and the state parts expanded to q's HQ heads, then
    run(q, k, v, s, g fp32, scale, hk0, hv0, cu int32 or None) -> (o, hk, hv); the final state
    returned per key/value head."""
    if g is None:
        w, g = slot_gate(s.astype(jnp.float32), cu_seqlens)
        s = w.astype(q.dtype)
    HQ, H = q.shape[2], k.shape[2]
    NG = HQ // H
    hk0, hv0 = initial_state if initial_state is not None else (None, None)
    if NG > 1:
        k, v, s, g = (jnp.repeat(x, NG, axis=2) for x in (k, v, s, g))
        hk0, hv0 = (None if x is None else jnp.repeat(x, NG, axis=1) for x in (hk0, hv0))
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    o, hk, hv = run(q, k, v, s, g.astype(jnp.float32), scale, hk0, hv0, cu)
    if not output_final_state:
        return o, None
    return o, (group_final(hk, NG), group_final(hv, NG))
