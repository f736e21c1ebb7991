"""BlockSpecs of the engine's kernels. Activations [B, T, H, D] are read in place: a block is
the whole time axis of one (batch row, head) and `width` columns; kernels load chunks of rows.

Sequential kernels run on grid (N, H, NK * NV) (program j -> K-block j // NV, V-block j % NV);
chunk-parallel kernels on grid (slots, H, NB) (one K- or V-block per program).
"""
from __future__ import annotations

from jax.experimental import pallas as pl

from . import varlen as vl
from .gates import GATE_KEY


def zero(j):
    return 0


def same(j):
    return j


def seq_rows(pb, width, col_block, parallel=False):
    """[B, T, H, D] activation (or key gate)."""
    if parallel:
        batch = vl.batch_of_slot(pb.varlen, pb.T, pb.bt)
    else:
        batch = (lambda n: 0) if pb.varlen else (lambda n: n)
    return pl.BlockSpec((None, pb.T, None, width),
                        lambda s, h, j: (batch(s), 0, h, col_block(j)))


def gate_rows(pb, width, col_block, parallel=False):
    """g: [B, T, H, K] (key gate, `width` columns) or [B, T, H] (scalar gate)."""
    if pb.gate == GATE_KEY:
        return seq_rows(pb, width, col_block, parallel)
    if parallel:
        batch = vl.batch_of_slot(pb.varlen, pb.T, pb.bt)
    else:
        batch = (lambda n: 0) if pb.varlen else (lambda n: n)
    return pl.BlockSpec((None, pb.T, None), lambda s, h, j: (batch(s), 0, h))


def state(rows, cols, row_block, col_block):
    """[N, H, K, V] fp32 state (initial / final / its cotangent), one tile per program."""
    return pl.BlockSpec((None, None, rows, cols), lambda n, h, j: (n, h, row_block(j), col_block(j)))


def chunk_states(pb, rows, cols, row_block, col_block):
    """[slots, H, Kp, Vp] per-chunk states: every slot of one head and tile (sequential
    kernels index the slot)."""
    return pl.BlockSpec((pb.n_slots, None, rows, cols),
                        lambda n, h, j: (0, h, row_block(j), col_block(j)))


def slot_state(rows, cols, row_block, col_block):
    """[slots, H, Kp, Vp] per-chunk states: the program's own slot (chunk-parallel kernels)."""
    return pl.BlockSpec((None, None, rows, cols),
                        lambda s, h, j: (s, h, row_block(j), col_block(j)))


def slot_vec(width):
    """[slots, H, width] per-chunk vector: the program's own slot (chunk-parallel kernels)."""
    return pl.BlockSpec((None, None, width), lambda s, h, j: (s, h, 0))


def chunk_vecs(pb, width, col_block=zero):
    """[slots, H, D] per-chunk vectors: every slot of one head, `width` columns (block
    col_block(j)) (sequential kernels index the slot)."""
    return pl.BlockSpec((pb.n_slots, None, width), lambda n, h, j: (0, h, col_block(j)))


def full(x):
    return pl.BlockSpec(x.shape, lambda s, h, j: (0,) * x.ndim)


def split(nb):
    """(K-block, V-block) of program j on a grid of NK * nb programs."""
    return (lambda j: j // nb), (lambda j: j % nb)
