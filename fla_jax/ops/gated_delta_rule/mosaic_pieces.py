"""Sequence split of the delta family's serial Mosaic passes (fixed-length inputs with few CTAs).

The serial passes run one CTA per (sequence, value head, 64 value columns): at B=1 T=32768 H=16
that is 32 CTAs on 132 SMs, each walking 512 chunks. Every sequence (fixed length or varlen: a
row of the passes' sequence table, which may be traced) is then cut into P pieces of whole
chunks that the passes take as separate sequences (rows of a piece table).
A piece maps the state affinely, S_end = M S_start + E (mosaic_map_ws.py forms [M^T ; E^T]
in one pass over the pieces); a scan over the pieces in fp32 (mosaic_piece_scan.py) gives
every piece its true start, and the forward (and the training forward, which also stores the chunk states) runs
from those. Backwards: dS_start = M^T dS_end + F, F the reverse pass from a zero end gradient
(mosaic_bwd_states_ws.py without stores); the scan gives every piece's end gradient, and the
real reverse pass runs from those. The result is the unsplit computation's up to rounding:
the carried state is fp32 in both, the maps are products of the same bf16/fp16 operands.

Only the maps that are read are walked: the forward reads E of pieces 0 .. P-2 and M of
pieces 1 .. P-2 (and M_0 with an initial state); the backward M of pieces 1 .. P-1 and F of
pieces 1 .. P-1.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .mosaic_fwd_kernel import BV, TABLE_WIDTH
from . import mosaic_map_ws, mosaic_piece_scan

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
# Split policy, read when an op is traced (H100: 132 SMs): only calls whose passes run at most
# MAX_CTAS CTAs; P a power of two with P * CTAs <= SMS (one wave of the output pass),
# P <= MAX_PIECES, at least MIN_PIECE_CHUNKS chunks a piece (MIN_CHUNKS_ABOVE_4 for more than
# four pieces; with varlen the mean chunks per sequence, as lengths may be traced). ENABLED =
# False turns the split off.
ENABLED = True
MAX_CTAS = 32
SMS = 132
MAX_PIECES = 8
MIN_PIECE_CHUNKS = 8
MIN_CHUNKS_ABOVE_4 = 32
# The scans' fp32 products: "kernel" (mosaic_piece_scan.py: one small Mosaic kernel with
# fp32-accurate split-bf16 tensor-core products; nothing for XLA to autotune) or "dot" (XLA
# einsums at HIGHEST precision, opt-in: XLA autotunes each step's GEMM fusion when it compiles;
# also what a head size the kernel does not take would use). H200 B1 T32768 GDN (RESULTS.md run
# 25): XLA's autotuning of the "dot" scans was ~15 s of the forward + step's 37-41 s first calls
# (30-32 s with the kernel); an optimization barrier making every step's fusion the same
# computation did not shorten it. ("sum", broadcast products summed over K, compiled 12 s
# faster than "dot" but ran 34 / 68 us slower per call (run 21): removed, the kernel does both.)
SCAN = "kernel"
SCANS = ("kernel", "dot")


def check_scan():
    """A bad SCAN raises a ValueError naming it (checked at the op's entry and at use)."""
    if SCAN not in SCANS:
        raise ValueError(f"mosaic_pieces.SCAN: got {SCAN!r}, expected one of {SCANS}")


def _kernel_scan(K: int, V: int) -> bool:
    check_scan()
    return SCAN == "kernel" and mosaic_piece_scan.supports(K, V)


def _affine(a, b, c, *, transposed: bool):
    """a b + c (or a b^T + c) in fp32 (XLA): a [B, HV, V, K] fp32, b [B, HV, K, J] (or
    [B, HV, J, K]), c [B, HV, V, J]."""
    return jnp.einsum("bhvk,bhjk->bhvj" if transposed else "bhvk,bhkj->bhvj", a, b,
                      precision=HIGHEST) + c


def pieces(N: int, HV: int, K: int, V: int, n_chunks: int, dtype) -> int:
    """Pieces per sequence (1: no split) for N sequences of n_chunks chunks (the mean)."""
    ctas = N * HV * (V // BV)
    if not ENABLED or ctas > MAX_CTAS or not mosaic_map_ws.supports(K, V, dtype):
        return 1
    return pieces_for_ctas(ctas, n_chunks)


def pieces_for_ctas(ctas: int, n_chunks: int) -> int:
    """The policy's P for passes of `ctas` CTAs over sequences of n_chunks chunks (the caller
    has checked ENABLED and MAX_CTAS): a power of two, P * ctas <= SMS, P <= MAX_PIECES,
    pieces of at least MIN_PIECE_CHUNKS chunks (MIN_CHUNKS_ABOVE_4 beyond four pieces)."""
    p = 1
    while (2 * p * ctas <= SMS and 2 * p <= MAX_PIECES
           and n_chunks // (2 * p) >= MIN_PIECE_CHUNKS
           and (2 * p <= 4 or n_chunks // (2 * p) >= MIN_CHUNKS_ABOVE_4)):
        p *= 2
    return p


def _xp(table):
    """numpy for a concrete (numpy) table, whose piece tables then are constants of the program
    (no XLA kernels per call to form them); jax.numpy for a traced one (varlen)."""
    return np if isinstance(table, np.ndarray) else jnp


def _ranges(table, P: int):
    """(first chunk, chunk count) int32 [N, P] of every piece: sequence n of the table
    ([N, TABLE_WIDTH] int32: first chunk, chunk count) in pieces of ceil(count / P) chunks."""
    xp = _xp(table)
    first, count = table[:, :1], table[:, 1:2]
    per = (count + P - 1) // P
    start = xp.minimum(xp.arange(P, dtype=np.int32)[None] * per, count)
    return first + start, xp.minimum(per, count - start)


def _rows(*cols):
    """int32 [N, P] columns -> the table [N * P, TABLE_WIDTH] (piece p of sequence n in row
    n * P + p)."""
    xp = _xp(cols[0])
    n = cols[0].size
    out = xp.stack([c.reshape(n) for c in cols], axis=1).astype(np.int32)
    return xp.pad(out, ((0, 0), (0, TABLE_WIDTH - len(cols))))


def _zero_piece(count, p: int):
    """count [N, P] with piece p's entries 0."""
    xp = _xp(count)
    return xp.where(xp.arange(count.shape[1])[None] == p, 0, count).astype(np.int32)


def piece_table(table, P: int, *, skip_first: bool = False, skip_last: bool = False):
    """int32 [N * P, TABLE_WIDTH]: (first chunk, chunk count) of every piece of the sequences
    of `table`, the sequence table of the passes run over pieces; skip_first: the first piece
    of each sequence walks no chunk (the reverse pass from a zero end gradient, whose first
    piece nobody reads); skip_last: the last one walks none (a state pass whose last piece's
    end nobody reads). numpy in, numpy out (constants of the program); else jax arrays."""
    first, count = _ranges(table, P)
    if skip_first:
        count = _zero_piece(count, 0)
    if skip_last:
        count = _zero_piece(count, P - 1)
    return _rows(first, count)


def map_table(table, P: int, *, first_map: bool, last_map: bool):
    """int32 [N * P, TABLE_WIDTH] for mosaic_map_ws.piece_maps: (first chunk, chunk count of
    the value blocks E, of the identity blocks M). E is walked for pieces 0 .. P-2, M for
    pieces 1 .. P-2, piece 0's with `first_map` (an initial state), piece P-1's with
    `last_map` (the backward's scan)."""
    first, count = _ranges(table, P)
    cval = _zero_piece(count, P - 1)
    cid = count if last_map else cval
    if not first_map:
        cid = _zero_piece(cid, 0)
    return _rows(first, cval, cid)


def forward_starts(maps, h0t, B: int, P: int, K: int):
    """maps [B * P, HV, K + V, K] fp32 ([M^T ; E^T] per piece), h0t None or [B, HV, V, K]
    (transposed initial states) -> the transposed state entering every piece
    [B * P, HV, V, K] fp32: S^T_{p+1} = S^T_p M_p^T + E_p^T."""
    if _kernel_scan(K, maps.shape[2] - K):
        return mosaic_piece_scan.piece_scan(maps, maps, None if h0t is None else h0t.astype(F32),
                                            N=B, P=P, K=K, x_row=K, backward=False)
    maps = maps.reshape((B, P) + maps.shape[1:])
    s = None if h0t is None else h0t.astype(F32)
    starts = []
    for p in range(P):
        starts.append(jnp.zeros_like(maps[:, 0, :, K:]) if s is None else s)
        if p + 1 < P:
            e = maps[:, p, :, K:]
            s = e if s is None else _affine(s, maps[:, p, :, :K], e, transposed=False)
    return jnp.stack(starts, 1).reshape((B * P,) + starts[0].shape[1:])


def backward_ends(F, maps, dhtT, B: int, P: int, K: int):
    """F [B * P, HV, V, K] (transposed state gradient at each piece's start from a zero end
    gradient), maps as for forward_starts, dhtT None or [B, HV, V, K] -> the transposed
    gradient of the state leaving every piece [B * P, HV, V, K] fp32:
    dS^T_start = dS^T_end M + F^T (M = the transpose of maps' rows :K)."""
    if _kernel_scan(K, F.shape[2]):
        return mosaic_piece_scan.piece_scan(maps, F, None if dhtT is None else dhtT.astype(F32),
                                            N=B, P=P, K=K, x_row=0, backward=True)
    F = F.reshape((B, P) + F.shape[1:])
    maps = maps.reshape((B, P) + maps.shape[1:])
    d = None if dhtT is None else dhtT.astype(F32)
    ends = [None] * P
    for p in reversed(range(P)):
        ends[p] = jnp.zeros_like(F[:, 0]) if d is None else d
        if p > 0:
            f = F[:, p]
            d = f if d is None else _affine(d, maps[:, p, :, :K], f, transposed=True)
    return jnp.stack(ends, 1).reshape((B * P,) + F.shape[2:])


def last_piece(x, B: int, P: int):
    """[B * P, ...] -> [B, ...]: each sequence's last piece."""
    return x.reshape((B, P) + x.shape[1:])[:, -1]


def first_piece(x, B: int, P: int):
    """[B * P, ...] -> [B, ...]: each sequence's first piece."""
    return x.reshape((B, P) + x.shape[1:])[:, 0]
