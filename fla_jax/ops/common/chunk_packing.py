"""Cut [B, T, HV, D] activations into chunks of C tokens: [B, NC, HV, C, D].

Fixed-length batches (cu_seqlens None): every row is padded at its end to NC * C tokens.
Varlen (cu_seqlens [N+1], B == 1, possibly traced under jit): every sequence is padded to a
multiple of C and the sequences are laid out chunk-aligned one after the other, so no chunk
mixes two sequences. The padded length has a STATIC upper bound,
    Tp = ceil((T + N * (C - 1)) / C) * C,
and every index (where each padded slot reads from, where each token's output lies, which
chunk starts a sequence) is computed with jnp ops from cu_seqlens. Padded slots hold zeros:
with k = v = 0, g = 0 and beta = 0 a padded token leaves the state unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax.numpy as jnp

from .token_recurrence import count_offsets_up_to, token_sequence_ids


@dataclass(frozen=True)
class ChunkPlan:
    """How a call is cut into chunks (arrays are jnp, possibly traced).

    chunk: C; num_chunks: NC per lane; lanes: B (fixed length) or 1 (varlen); T: tokens.
    Varlen only (None otherwise): src [Tp] token read by each padded slot, valid [Tp],
    token_pos [T] padded slot of each token, reset [NC] chunk starts a sequence,
    chunk_seq [NC] sequence of each chunk, last_chunk [N] last chunk of each sequence,
    seq_len [N].
    """

    chunk: int
    num_chunks: int
    lanes: int
    T: int
    src: Optional[jnp.ndarray] = None
    valid: Optional[jnp.ndarray] = None
    token_pos: Optional[jnp.ndarray] = None
    reset: Optional[jnp.ndarray] = None
    chunk_seq: Optional[jnp.ndarray] = None
    last_chunk: Optional[jnp.ndarray] = None
    seq_len: Optional[jnp.ndarray] = None

    @property
    def varlen(self) -> bool:
        return self.src is not None


def plan_chunks(B: int, T: int, cu_seqlens, chunk: int) -> ChunkPlan:
    """Build the ChunkPlan of a [B, T] call with chunk size `chunk`."""
    C = chunk
    if cu_seqlens is None:
        return ChunkPlan(C, -(-T // C), B, T)
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    N = cu.shape[0] - 1
    NC = -(-(T + N * (C - 1)) // C)
    Tp = NC * C
    seq_len = cu[1:] - cu[:-1]
    padded_len = (seq_len + (C - 1)) // C * C
    pad_off = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded_len)])
    pad_off = pad_off.astype(jnp.int32)

    p = jnp.arange(Tp, dtype=jnp.int32)
    n = count_offsets_up_to(pad_off[1:], Tp)           # sequence of each slot; N past the end
    nc = jnp.minimum(n, N - 1)
    local = p - pad_off[nc]
    valid = (n < N) & (local < seq_len[nc])
    src = jnp.where(valid, cu[nc] + local, 0)

    seq_id, _ = token_sequence_ids(cu, T)
    token_pos = pad_off[seq_id] + jnp.arange(T, dtype=jnp.int32) - cu[seq_id]

    chunk_start = jnp.arange(NC, dtype=jnp.int32) * C
    cn = n[::C]
    cn_c = jnp.minimum(cn, N - 1)
    reset = (cn < N) & (chunk_start == pad_off[cn_c])
    last_chunk = jnp.maximum(pad_off[1:] // C - 1, 0)
    return ChunkPlan(C, NC, 1, T, src=src, valid=valid, token_pos=token_pos, reset=reset,
                     chunk_seq=cn_c, last_chunk=last_chunk, seq_len=seq_len)


def to_chunks(plan: ChunkPlan, x):
    """[B, T, HV, *D] -> [B, NC, HV, C, *D] with zero padding (see module doc)."""
    B, T = x.shape[:2]
    rest = x.shape[2:]
    NC, C = plan.num_chunks, plan.chunk
    if plan.varlen:
        valid = plan.valid.reshape((-1,) + (1,) * len(rest))
        xp = jnp.where(valid, x[0][plan.src], jnp.zeros((), x.dtype))[None]
    else:
        pad = NC * C - T
        xp = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * len(rest)) if pad else x
    xp = xp.reshape((B, NC, C) + rest)
    return jnp.moveaxis(xp, 3, 2)


def from_chunks(plan: ChunkPlan, y):
    """[B, NC, HV, C, V] -> [B, T, HV, V] (drops the padding)."""
    B, NC, HV, C, V = y.shape
    y = jnp.moveaxis(y, 2, 3).reshape(B, NC * C, HV, V)
    if plan.varlen:
        return y[0][plan.token_pos][None]
    return y[:, :plan.T]


def chunk_initial_states(plan: ChunkPlan, initial_state, shape, dtype):
    """(first carry [lanes, HV, K, V], per-chunk reset states [NC, HV, K, V] or None).

    shape = (HV, K, V). Fixed length: the carry starts at initial_state (or 0) per row.
    Varlen: the carry starts at 0 and every chunk with plan.reset that starts sequence n
    resets to initial_state[n] (None here means: reset to 0)."""
    if not plan.varlen:
        if initial_state is None:
            return jnp.zeros((plan.lanes,) + tuple(shape), dtype), None
        return initial_state.astype(dtype), None
    if initial_state is None:
        return jnp.zeros((1,) + tuple(shape), dtype), None
    return jnp.zeros((1,) + tuple(shape), dtype), initial_state.astype(dtype)[plan.chunk_seq]


def gather_final_states(plan: ChunkPlan, states_after, last_carry, initial_state, shape,
                        dtype):
    """final_state [N, HV, K, V]: the state after each sequence's last chunk.

    states_after: [NC, lanes, HV, K, V] (varlen) or None; last_carry: [lanes, HV, K, V].
    A zero-length sequence returns its initial state (or 0)."""
    if not plan.varlen:
        return last_carry
    finals = states_after[plan.last_chunk, 0]
    h0 = (jnp.zeros((plan.seq_len.shape[0],) + tuple(shape), dtype) if initial_state is None
          else initial_state.astype(dtype))
    keep = (plan.seq_len > 0).reshape(-1, 1, 1, 1)
    return jnp.where(keep, finals, h0)
