"""Sequence split of the serial Mosaic passes (fixed-length inputs with few CTAs).

The serial kernels run one CTA per (sequence, head, 64 value columns); with few long sequences
(B=1, T=32768) most SMs idle. Every sequence is then cut into P pieces of whole chunks that
run as separate "sequences" of the varlen path (the [B, Tp] rows viewed as one packed row of
B * Tp). A piece maps the state at its start affinely: S_end = 2^A S_start + E, with A the
piece's summed log2-decay and E its final state from zero (the 'final' forward pass). A scan
over the pieces (XLA, fp32) gives each piece's true initial state; the real pass then runs
from those. Backwards the same with dS_start = 2^A dS_end + F (F: the dstate pass from a zero
end gradient). Both scans: common/mosaic/piece_scan.py (2^A by piece_factor).
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from .mosaic_fwd import BV, C, SEQ_COLS

# Split policy, read when an op is traced: split only when the serial passes would run at
# most MAX_CTAS CTAs; pieces of at least MIN_PIECE_CHUNKS chunks; at most TARGET_CTAS CTAs.
POLICY = {"max_ctas": 64, "min_piece_chunks": 16, "target_ctas": 264}


def pieces(B: int, H: int, V: int, n_chunks: int, varlen: bool) -> int:
    """Pieces per sequence (1: no split)."""
    ctas = B * H * (V // BV)
    if varlen or ctas > POLICY["max_ctas"]:
        return 1
    p = 1
    while (2 * p * ctas <= POLICY["target_ctas"]
           and n_chunks // (2 * p) >= POLICY["min_piece_chunks"]):
        p *= 2
    return p


def table(B: int, n_chunks: int, P: int):
    """int32 [B * P, SEQ_COLS] (first chunk, chunk count) of every piece in the flat row."""
    per = -(-n_chunks // P)
    rows = np.zeros((B * P, SEQ_COLS), np.int32)
    for b in range(B):
        for p in range(P):
            first = min(p * per, n_chunks)
            rows[b * P + p, 0] = b * n_chunks + first
            rows[b * P + p, 1] = min(per, n_chunks - first)
    return jnp.asarray(rows)


def piece_decay(g2, B: int, P: int):
    """g2 [1, H, B * Tp] (chunk-local log2 cumsums) -> [B, P, H] summed log2-decay per piece."""
    H, BT = g2.shape[1], g2.shape[2]
    n_chunks = BT // C // B
    per = -(-n_chunks // P)
    last = g2.reshape(H, B, n_chunks, C)[..., -1]                 # [H, B, NT]
    last = jnp.pad(last, ((0, 0), (0, 0), (0, per * P - n_chunks)))
    return jnp.transpose(last.reshape(H, B, P, per).sum(-1), (1, 2, 0))


def piece_factor(A):
    """A [B, P, H] (summed log2-decays) -> exp2(A) broadcasting over a piece's [H, V, K]
    states (common/mosaic/piece_scan.py)."""
    return jnp.exp2(A)[..., None, None]
