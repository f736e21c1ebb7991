"""Chunk-aligned time layout for the Mosaic GPU kernels, without a host sync.

The kernels read whole chunks of C rows with TMA, so every sequence must start at a multiple
of C and its rows past its end must be zero. Fixed length ([B, T, ...]): T is padded to Tp, a
multiple of C. Varlen (B == 1, cu_seqlens [N+1]): sequence n moves to rows
C * first[n] .. of a buffer of static length Tp = C * (ceil(T / C) + N) (each sequence wastes
less than one chunk), with first[n] = sum_{m<n} ceil(L_m / C); the index maps are computed on
device from cu_seqlens (traced values are fine).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


class Layout(NamedTuple):
    """T: original length; Tp: packed length; seq: None (fixed length) or int32 [N, cols]
    (column 0: first chunk of sequence n, column 1: its chunk count, the rest 0); src: int32
    [Tp] original row of each packed row (T where the row is padding); pos: int32 [T] packed
    row of each original row."""
    T: int
    Tp: int
    seq: Optional[jax.Array]
    src: Optional[jax.Array]
    pos: Optional[jax.Array]


def plan(T: int, cu_seqlens, chunk: int, seq_cols: int) -> Layout:
    if cu_seqlens is None:
        return Layout(T, -(-T // chunk) * chunk, None, None, None)
    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    lengths = cu[1:] - cu[:-1]
    chunks = (lengths + chunk - 1) // chunk
    first = jnp.cumsum(chunks) - chunks                       # exclusive cumsum
    Tp = chunk * (-(-T // chunk) + N)
    rows = jnp.arange(Tp, dtype=jnp.int32)
    n_of_row = jnp.clip(jnp.searchsorted(first * chunk, rows, side="right") - 1, 0, N - 1)
    offset = rows - first[n_of_row] * chunk
    src = jnp.where(offset < lengths[n_of_row], cu[n_of_row] + offset, T).astype(jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    n_of_t = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, N - 1)
    pos = (first[n_of_t] * chunk + t - cu[n_of_t]).astype(jnp.int32)
    seq = jnp.zeros((N, seq_cols), jnp.int32)
    seq = seq.at[:, 0].set(first.astype(jnp.int32)).at[:, 1].set(chunks.astype(jnp.int32))
    return Layout(T, Tp, seq, src, pos)


def pack(x, lay: Layout):
    """x [B, T, ...] -> [B, Tp, ...] in the chunk-aligned layout (padding rows zero)."""
    if lay.src is None:
        if lay.Tp == lay.T:
            return x
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, lay.Tp - lay.T)
        return jnp.pad(x, widths)
    zero = jnp.zeros((x.shape[0], 1) + x.shape[2:], x.dtype)
    return jnp.take(jnp.concatenate([x, zero], axis=1), lay.src, axis=1)


def unpack(y, lay: Layout):
    """y [B, Tp, ...] -> [B, T, ...]: the rows of the original tokens."""
    if lay.pos is None:
        return y if lay.Tp == lay.T else y[:, :lay.T]
    return jnp.take(y, lay.pos, axis=1)
