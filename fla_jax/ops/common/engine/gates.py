"""Gate switch of the chunk engine and its one accurate gate-gap arithmetic (all fp32).

GATE_NONE: no decay. GATE_SCALAR: log-decay g [B, T, H] (one per token and head).
GATE_KEY: log-decay g [B, T, H, K] (one per token, head and key channel).
Inside a kernel every gate is handled as a [rows, width] tile (a scalar gate broadcast over
the key columns), so one code path serves both gated variants.

Cumulative log-decays are kept split, `Cum(hi, lo)`: hi = the gates rounded to a 2^-8 grid
(their running sums are exact in fp32 below 2^15) and lo = the small rest. A gap
b_i - b_j = (hi_i - hi_j) + (lo_i - lo_j) then keeps the accuracy of the gap itself even where
the cumsums reach -1000s (two plain fp32 cumsums cost ~1e-4 absolute in the exponent under
gates of -20 per token), and a zero-length gap is exactly 0.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from .. import pallas_triton as ptr

GATE_NONE, GATE_SCALAR, GATE_KEY = 0, 1, 2
GATES = (GATE_NONE, GATE_SCALAR, GATE_KEY)


# Largest decay (nats) across one SUB-row sub-chunk for which a diagonal sub-block of the
# intra-chunk scores (and of their backward) is formed as one fp32-accurate dot through the
# sub-chunk's start: its factors exp(+-loc) stay within e^20 and are exact fp32 numbers, and
# each pair's exponent error stays ~20 * 6e-8. Stronger decays take the per-pair path.
SPAN = 20.0


class Cum(NamedTuple):
    """A cumulative log-decay, split: value = hi + lo (fp32 arrays of one shape)."""
    hi: object
    lo: object

    def value(self):
        return self.hi + self.lo


def zero_cum(width):
    z = jnp.zeros((width,), jnp.float32)
    return Cum(z, z)


def load_gate(ref, gate, start, rows, n_valid, width, n_cols, col0=0):
    """Raw log-decay tile [rows, width] fp32 (0 on masked rows / columns), or None for
    GATE_NONE. ref: [T] (scalar gate, broadcast over columns) or [T, width] (key gate)."""
    if gate == GATE_NONE:
        return None
    if gate == GATE_SCALAR:
        g = ptr.load_rows(ref, start, rows, n_valid).astype(jnp.float32)
        return jnp.broadcast_to(g[:, None], (rows, width))
    return ptr.load_rows(ref, start, rows, n_valid, n_cols, col0).astype(jnp.float32)


def split(g) -> Cum:
    """Raw log-decays (any shape) as Cum(hi on the 2^-8 grid, lo the rest): one row of a
    running sum `add(r, split(g_row))` equals cumsum's row up to the order of the lo sums."""
    hi = jnp.floor(g * 256.0 + 0.5) * (1.0 / 256.0)
    return Cum(hi, g - hi)


def cumsum(g):
    """g [rows, width] -> (Cum of the inclusive cumsum over rows, Cum of the column totals)."""
    hi, lo = split(g)
    return (Cum(jnp.cumsum(hi, axis=0), jnp.cumsum(lo, axis=0)),
            Cum(jnp.sum(hi, axis=0), jnp.sum(lo, axis=0)))


def add(a: Cum, b: Cum) -> Cum:
    return Cum(a.hi + b.hi, a.lo + b.lo)


def gap(a: Cum, b: Cum):
    """a - b (broadcasting), formed part by part."""
    return (a.hi - b.hi) + (a.lo - b.lo)


def row(c: Cum, r) -> Cum:
    """Row r (may be traced) of a [rows, width] Cum as a [width] Cum (a masked sum: tiles
    cannot be sliced in the Triton lowering)."""
    sel = (jnp.arange(c.hi.shape[0]) == r)[:, None]
    return Cum(jnp.sum(jnp.where(sel, c.hi, 0.0), axis=0), jnp.sum(jnp.where(sel, c.lo, 0.0), axis=0))


def masked_exp(x, mask):
    """exp(x) where mask else 0, masked before exp (no overflow in the unused entries)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def bcast(c: Cum) -> Cum:
    """[width] Cum -> [1, width] (to broadcast against a [rows, width] tile)."""
    return Cum(c.hi[None, :], c.lo[None, :])


def span(later: Cum, earlier: Cum, loc: Cum):
    """(later - earlier) - loc for [width] Cums later / earlier and a [rows, width] Cum loc:
    the log-decay from rows of a sub-chunk (cumsum loc from its start `earlier`) to `later`."""
    return ((later.hi - earlier.hi)[None, :] - loc.hi) + ((later.lo - earlier.lo)[None, :] - loc.lo)


def sub_chunk_split(b: Cum, sub: int):
    """b [bt, w] (a chunk's inclusive cumsum) -> (Rs, loc): Rs[I] = b just before sub-chunk I
    of `sub` rows ([w] Cum; zero for I = 0) and loc = b - Rs[row's sub-chunk] ([bt, w] Cum, the
    cumsum from the row's sub-chunk start; every part exact as in `gap`)."""
    n = b.hi.shape[0] // sub
    part = (jnp.arange(b.hi.shape[0]) // sub)[:, None]
    Rs = [row(b, I * sub - 1) for I in range(n)]
    P = Cum(sum(jnp.where(part == I, R.hi[None, :], 0.0) for I, R in enumerate(Rs)),
            sum(jnp.where(part == I, R.lo[None, :], 0.0) for I, R in enumerate(Rs)))
    return Rs, Cum(b.hi - P.hi, b.lo - P.lo)
