"""The scans over sequence pieces of the serial passes whose state map is diagonal (simple GLA:
one decay per head; GLA: one per key), in fp32 (XLA, unrolled over the P pieces).

A piece maps the state entering it to the state leaving it as S_end = D_p S_start + E_p, with
D_p elementwise (a factor broadcast over the state's [H, V, K] axes) and E_p the end state from
zero; backwards dS_start = D_p dS_end + F_p, F_p the start gradient from a zero end gradient.
"""
from __future__ import annotations

import jax.numpy as jnp


def diagonal_starts(E, D, s0, N: int, P: int):
    """E [N * P, ...] (end states from zero), D [N, P, ...] (each piece's factor, broadcasting
    against E's rows), s0 None (zeros) or [N, ...] -> (the state entering every piece
    [N * P, ...] fp32, the state leaving each sequence's last piece [N, ...])."""
    E = E.reshape((N, P) + E.shape[1:])
    s = jnp.zeros_like(E[:, 0]) if s0 is None else s0.astype(jnp.float32)
    starts = []
    for p in range(P):
        starts.append(s)
        s = D[:, p] * s + E[:, p]
    return jnp.stack(starts, 1).reshape((N * P,) + E.shape[2:]), s


def diagonal_ends(F, D, d0, N: int, P: int):
    """F [N * P, ...] (start gradients from a zero end gradient), D as for diagonal_starts,
    d0 [N, ...] (the gradient of each sequence's final state) -> (the gradient of the state
    leaving every piece [N * P, ...] fp32, the gradient of each sequence's initial state)."""
    F = F.reshape((N, P) + F.shape[1:])
    d = d0.astype(jnp.float32)
    ends = [None] * P
    for p in reversed(range(P)):
        ends[p] = d
        d = D[:, p] * d + F[:, p]
    return jnp.stack(ends, 1).reshape((N * P,) + F.shape[2:]), d
