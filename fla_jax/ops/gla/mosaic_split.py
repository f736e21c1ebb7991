"""Sequence split of chunked GLA's serial Mosaic passes (SPLIT, the default; H100 B1 T32768
H16 bf16, RESULTS.md run 23 call 1: fwd 1.182 -> 0.984 ms, fwd+bwd 4.338 -> 4.082, jla 1.030 /
4.394).

The forward's state pass and the backward's reverse pass run one CTA per (sequence, head, 64
value columns): at B1 T32768 H16 that is 32 CTAs of 512 chunks each. With SPLIT every sequence
(a row of the passes' table, fixed length or varlen) is cut into P pieces of whole chunks
(gated_delta_rule/mosaic_pieces.py's policy and piece tables). GLA's decay is diagonal per key,
so a piece maps the transposed state as S^T_end = S^T_start diag(exp2(L_p)) + E^T_p, L_p the
summed chunk decays of the piece (log2 units) and E_p its end state from zero (the scans:
common/mosaic/piece_scan.py):
- forward (mosaic_chunk.forward): a state pass from zero over pieces 0 .. P-2 gives E, an
  elementwise fp32 scan the starts, the output pass (with the training forward's stored
  states) runs over pieces from them;
- backward (mosaic_bwd.backward): the reverse pass from a zero end gradient over pieces 1 .. P-1
  gives F_p (the gradient at the piece's start), dS^T_start = dS^T_end diag(exp2(L_p)) + F^T_p
  scanned backwards gives every piece's end gradient, the reverse pass runs over pieces from
  them; dh0 is the first piece's start gradient.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..gated_delta_rule import mosaic_pieces
from ..gated_delta_rule.mosaic_fwd_kernel import BV, C

# Read when an op is traced.
SPLIT = True


def pieces(N: int, H: int, V: int, n_chunks: int) -> int:
    """Pieces per sequence (1: none): mosaic_pieces' policy (at most MAX_CTAS CTAs unsplit,
    one wave of P * CTAs, pieces of at least MIN_PIECE_CHUNKS chunks)."""
    ctas = N * H * (V // BV)
    if not (SPLIT and mosaic_pieces.ENABLED) or ctas > mosaic_pieces.MAX_CTAS:
        return 1
    return mosaic_pieces.pieces_for_ctas(ctas, n_chunks)


def pieces_for(lay, N: int, H: int, V: int, varlen: bool) -> int:
    """pieces() for the row layout `lay` (packing.plan) of N sequences: chunks per sequence,
    the mean with varlen (its packed length holds one spare chunk a sequence)."""
    return pieces(N, H, V, (lay.Tp // C - (N if varlen else 0)) // N)


def piece_decay(last, ptab):
    """last [H, NC, K] fp32 (each chunk's summed log2-decay per key) and the piece table
    [NP, TABLE_WIDTH] (first chunk, chunk count; pieces in chunk order) -> [NP, H, K]: each
    piece's summed decay (a segment sum, no cumsum differences)."""
    NP, NC = ptab.shape[0], last.shape[1]
    ptab = jnp.asarray(ptab)      # a numpy constant (fixed length) or traced (varlen)
    first, count = ptab[:, 0], ptab[:, 1]
    c = jnp.arange(NC, dtype=jnp.int32)
    piece = jnp.clip(jnp.searchsorted(first + count, c, side="right"), 0, NP - 1)
    inside = (c >= first[piece]) & (c < first[piece] + count[piece])
    x = jnp.where(inside[:, None, None], jnp.swapaxes(last, 0, 1), 0.0)     # [NC, H, K]
    return jax.ops.segment_sum(x, piece, num_segments=NP)


def piece_factor(L, N: int, P: int):
    """L [N * P, H, K] (summed log2-decays) -> exp2(L) [N, P, H, 1, K], broadcasting over a
    piece's transposed [H, V, K] states (common/mosaic/piece_scan.py)."""
    return jnp.exp2(L).reshape((N, P, L.shape[1], 1, L.shape[2]))
