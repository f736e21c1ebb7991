"""The engine's one varlen scheme: per-chunk buffers indexed by a slot, no host sync.

Chunk c of sequence n (first token bos) owns slot
    varlen:      bos // BT + n + c      (cdiv(T, BT) + N slots; distinct for all chunks of all
                                          sequences, some slots unused)
    fixed size:  n * cdiv(T, BT) + c    (N * cdiv(T, BT) slots)
Sequential kernels (one program per sequence) compute the slot from (n, bos, c); chunk-parallel
kernels (one program per slot) read the slot's sequence from `slot_sequences` (a jnp
searchsorted, traced-safe) and find (bos, length, c) from cu_seqlens inside the kernel.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl


def n_chunks(T, bt):
    return -(-T // bt)


def n_slots(T, bt, N, varlen):
    """Rows of a per-chunk buffer."""
    return n_chunks(T, bt) + N if varlen else N * n_chunks(T, bt)


def first_slot(varlen, T, bt, n, bos):
    """Slot of chunk 0 of sequence n (its chunk c has slot first_slot + c)."""
    if varlen:
        return bos // bt + n
    return n * n_chunks(T, bt)


def sequence_bounds(refs, varlen, T, n):
    """(bos, length) of sequence n: from cu_seqlens (refs['cu'], int32 [N+1]) or (0, T)."""
    if varlen:
        bos = refs["cu"][n]
        return bos, refs["cu"][n + 1] - bos
    return 0, T


def slot_sequences(cu, T, bt):
    """cu int32 [N+1] (may be traced) -> int32 [cdiv(T, bt) + N]: the sequence owning each
    slot (the last sequence whose first slot is <= the slot)."""
    N = cu.shape[0] - 1
    first = cu[:-1] // bt + jnp.arange(N, dtype=jnp.int32)
    slots = jnp.arange(n_slots(T, bt, N, True), dtype=jnp.int32)
    return jnp.clip(jnp.searchsorted(first, slots, side="right") - 1, 0, N - 1).astype(jnp.int32)


def slot_table(cu, T, bt, varlen):
    """The slots as a table, for kernels that take (start, end) per slot program and the
    first slot of each sequence (the scalar-gate delta rule). cu int32 [N+1]: token offsets
    into the flattened axis (may be traced); T: that axis' length (varlen) or each sequence's
    (fixed size). Returns (table int32 [slots, 2]: the (start, end) tokens of the slot's chunk,
    (0, 0) for an unused slot; first int32 [N]: the slot of each sequence's chunk 0)."""
    N = cu.shape[0] - 1
    if not varlen:
        nt = n_chunks(T, bt)
        s = jnp.arange(N * nt, dtype=jnp.int32)
        start = (s // nt) * T + (s % nt) * bt
        end = jnp.minimum(start + bt, (s // nt + 1) * T)
        return jnp.stack([start, end], axis=1), jnp.arange(N, dtype=jnp.int32) * nt
    first = cu[:-1] // bt + jnp.arange(N, dtype=jnp.int32)
    seq = slot_sequences(cu, T, bt)
    s = jnp.arange(seq.shape[0], dtype=jnp.int32)
    start = cu[seq] + (s - first[seq]) * bt
    end = jnp.minimum(start + bt, cu[seq + 1])
    valid = start < end
    return jnp.stack([jnp.where(valid, start, 0), jnp.where(valid, end, 0)], axis=1), first


def slot_chunk(refs, varlen, T, bt, s):
    """Chunk-parallel program on slot s -> (batch row n, bos, chunk c, rows n_valid).
    n_valid <= 0 for unused slots (every load and store of the program is then masked)."""
    if varlen:
        n = refs["seq"][s]
        bos, L = sequence_bounds(refs, True, T, n)
        c = s - first_slot(True, T, bt, n, bos)
        nv = jnp.where(c >= 0, L - c * bt, 0)
        return n, bos, c, nv
    nt = n_chunks(T, bt)
    c = s % nt
    return s // nt, 0, c, T - c * bt


def batch_of_slot(varlen, T, bt):
    """Index-map helper: the batch row of the [B, T, ...] block a slot program reads."""
    if varlen:
        return lambda s: 0
    nt = n_chunks(T, bt)
    return lambda s: s // nt


def cdiv(a, b):
    return pl.cdiv(a, b)
