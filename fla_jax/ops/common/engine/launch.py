"""Launch configuration of the engine's kernels and the static problem they run on.

`Problem`: the static description of one call (shapes, gate switch, varlen, scale,
precision, chunk length). `Launch`: one kernel's tile sizes and Triton parameters.
`launch_for(kernel, K, V, dtype)`: the heuristic, sized so that every kernel fits the H100's
shared memory (~227 KiB per block) in every dtype (fp32 tiles: one pipeline stage).
`call(...)`: one pallas_call with named inputs / outputs (refs reach the kernel as a dict).
BlockSpecs of the kernels (seq_rows, gate_rows, state, chunk_states, slot_state, ...) and the
masks the shapes need (rows, cols).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from . import varlen as vl
from .gates import GATE_KEY

KERNELS = ("state_fwd", "state_bwd", "output_fwd", "output_dv", "output_dqk")
STATE_TILE_BYTES = 32 * 1024
# kernel -> Launch, read when an op is traced (benchmarks / tuning runs set it; empty: heuristic)
OVERRIDES: dict = {}
SUB = 16           # sub-chunk length of the key-gate intra-chunk scores (tl.dot needs >= 16)


@dataclass(frozen=True)
class Problem:
    """Static description of one engine call. gate: gates.GATE_*; bt: chunk length (a
    multiple of SUB); state_dtype: dtype of the per-chunk states h / dh buffers (the
    activations' dtype: halves their traffic in bf16/fp16; each product casts them to it)."""
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    scale: float
    varlen: bool
    gate: int
    has_h0: bool
    precision: object
    bt: int = 64
    state_dtype: str = "float32"

    @property
    def Kp(self):
        return ptr.padded(self.K)

    @property
    def Vp(self):
        return ptr.padded(self.V)

    @property
    def n_slots(self):
        return vl.n_slots(self.T, self.bt, self.N, self.varlen)


@dataclass(frozen=True)
class Launch:
    """bk / bv: K- and V-block widths (None: the whole padded head size)."""
    bk: int | None
    bv: int | None
    num_warps: int
    num_stages: int


def launch_for(kernel: str, K: int, V: int, dtype) -> Launch:
    """Heuristic launch configuration for `kernel` (one of KERNELS). A program's state tile
    (an operand of its products, staged in shared memory) is kept <= STATE_TILE_BYTES.
    The output-stage choices are the fewest register spills of an offline sm_90a compile
    (K = V = 128; bf16 and fp32), not GPU timings. OVERRIDES takes a tuning run's choice."""
    if kernel not in KERNELS:
        raise ValueError(f"launch_for: kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
    if kernel in OVERRIDES:
        return OVERRIDES[kernel]
    Kp, Vp = ptr.padded(K), ptr.padded(V)
    size = jnp.dtype(dtype).itemsize
    stages = 1 if size == 4 else 2

    def fit(other, full):
        """Widest power-of-two block (16 .. full) with other x block x size within the cap."""
        b = full
        while b > 16 and other * b * size > STATE_TILE_BYTES:
            b //= 2
        return b

    if kernel in ("state_fwd", "state_bwd"):
        return Launch(min(Kp, 64), min(Vp, 64), 4, stages)
    if kernel == "output_fwd":
        # key channels in slices of 16 (one slice's tiles and its [16, 16, 16] diagonal pair
        # tile live at a time); all of V per program in 16-bit (the scores formed once per
        # chunk), 64 columns in fp32; one stage
        return Launch(min(Kp, 16), Vp if size < 4 else min(Vp, 64), 8, 1)
    if kernel == "output_dv":
        return Launch(None, min(fit(Kp, Vp), 64 if size < 4 else 32), 8, stages)
    return Launch(min(32, fit(Vp, Kp)), None, 8, stages)


def call(kernel, grid, inputs, outputs, launch: Launch, name: str):
    """inputs / outputs: lists of (name, array-or-ShapeDtypeStruct, BlockSpec); kernel(refs)
    gets {name: Ref}. Returns {output name: array}."""
    names = [n for n, _, _ in inputs] + [n for n, _, _ in outputs]

    def body(*refs):
        kernel(dict(zip(names, refs)))

    out = pl.pallas_call(
        body, grid=grid,
        in_specs=[s for _, _, s in inputs],
        out_specs=[s for _, _, s in outputs],
        out_shape=[a for _, a, _ in outputs],
        compiler_params=ptr.compiler_params(launch.num_warps, launch.num_stages),
        interpret=ptr.interpret(), name=name,
    )(*[a for _, a, _ in inputs])
    return dict(zip([n for n, _, _ in outputs], out))


def width(size_p, block):
    return size_p if block is None else min(size_p, block)


# ----------------------------------------------------------------------------- BlockSpecs
# Activations [B, T, H, D] are read in place: a block is the whole time axis of one (batch
# row, head) and `width` columns; kernels load chunks of rows. Sequential kernels run on grid
# (N, H, NK * NV) (program j -> K-block j // NV, V-block j % NV); chunk-parallel kernels on
# grid (slots, H, NB) (one K- or V-block per program).


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


def full(x):
    return pl.BlockSpec(x.shape, lambda s, h, j: (0,) * x.ndim)


def zero(j):
    return 0


def same(j):
    return j


def split(nb):
    """(K-block, V-block) of program j on a grid of NK * nb programs."""
    return (lambda j: j // nb), (lambda j: j % nb)


def rows(pb, n_valid):
    """Row bound for a chunk's loads / stores: None (no mask) when every chunk is full."""
    return None if (not pb.varlen and pb.T % pb.bt == 0) else n_valid


def cols(size, width):
    """Column bound: None (no mask) when blocks of `width` tile `size` exactly."""
    return None if size % width == 0 else size
