"""Launch configuration of the engine's kernels and the static problem they run on.

`Problem`: the static description of one call (shapes, gate switch, varlen, scale,
precision, chunk length). `Launch`: one kernel's tile sizes and Triton parameters.
`launch_for(kernel, K, V, dtype)`: the heuristic, sized so that every kernel fits the H100's
shared memory (~227 KiB per block) in every dtype (fp32 tiles: one pipeline stage).
`call(...)`: one pallas_call with named inputs / outputs (refs reach the kernel as a dict).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from . import varlen as vl

KERNELS = ("cumsum_scores", "state_fwd", "state_bwd", "output_fwd", "output_dv", "output_dqk",
           "output_intra", "output_inter")
STATE_TILE_BYTES = 32 * 1024
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
    (an operand of its products, staged in shared memory) is kept <= STATE_TILE_BYTES."""
    if kernel not in KERNELS:
        raise ValueError(f"launch_for: kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
    Kp, Vp = ptr.padded(K), ptr.padded(V)
    size = jnp.dtype(dtype).itemsize
    stages = 1 if size == 4 else 2

    def fit(other, full):
        """Widest power-of-two block (16 .. full) with other x block x size within the cap."""
        b = full
        while b > 16 and other * b * size > STATE_TILE_BYTES:
            b //= 2
        return b

    if kernel == "cumsum_scores":
        # 16-bit: key blocks of 64 (FRAME "chunk", H100 session 10: 0.543 ms against 0.605 at
        # 32); fp32 (3xTF32 dots, more live tiles): 32, as Triton's
        return Launch(min(Kp, 64 if size < 4 else 32), None, 4, stages)
    if kernel in ("state_fwd", "state_bwd"):
        return Launch(min(Kp, 64), min(Vp, 64), 4, stages)
    if kernel in ("output_fwd", "output_dv"):
        # as much of V per program as fits: the intra-chunk scores are formed once per program
        return Launch(None, fit(Kp, Vp), 4, stages)
    if kernel == "output_intra":
        # measured (H100, GLA bf16 K=V=128, session 10): bk 32 / 4 warps 1.17 ms, 64 / 8 1.40,
        # 64 / 4 1.65, 128 / 8 2.00
        return Launch(min(32, Kp), None, 4, stages)
    if kernel == "output_inter":
        # same run: bk 64 / 8 warps 1.05 ms, 32 / 4 1.17, 64 / 4 1.21, 128 / 8 1.31
        return Launch(min(64, fit(Vp, Kp)), None, 8, stages)
    return Launch(min(64, fit(Vp, Kp)), None, 4, stages)


def call(kernel, grid, inputs, outputs, launch: Launch, name: str, aliases=None):
    """inputs / outputs: lists of (name, array-or-ShapeDtypeStruct, BlockSpec); kernel(refs)
    gets {name: Ref}. aliases: {input name: output name} updated in place (the output starts
    as that input; what the kernel does not store keeps its value). Returns {output name:
    array}."""
    names = [n for n, _, _ in inputs] + [n for n, _, _ in outputs]
    ins, outs = [n for n, _, _ in inputs], [n for n, _, _ in outputs]
    io = {ins.index(a): outs.index(b) for a, b in (aliases or {}).items()}

    def body(*refs):
        kernel(dict(zip(names, refs)))

    out = pl.pallas_call(
        body, grid=grid,
        in_specs=[s for _, _, s in inputs],
        out_specs=[s for _, _, s in outputs],
        out_shape=[a for _, a, _ in outputs],
        compiler_params=ptr.compiler_params(launch.num_warps, launch.num_stages),
        interpret=ptr.interpret(), name=name, input_output_aliases=io,
    )(*[a for _, a, _ in inputs])
    return dict(zip([n for n, _, _ in outputs], out))


def blocks(n: int, body, init=0):
    """body(i, carry) over i = 0 .. n - 1 (static n): one direct call when n == 1 (no loop in
    the kernel's IR), else lax.fori_loop. Returns the final carry."""
    return body(0, init) if n == 1 else lax.fori_loop(0, n, body, init)


def width(size_p, block):
    return size_p if block is None else min(size_p, block)


# Scalar-gate delta rule (scalar_delta*.py, scalar_wy_fwd.py): launch tiles of its kernels,
# picked from K, V and dtype.
#
# Why a table: the Triton lowering stages every dot operand through shared memory, and an
# H100 gives one program at most 227 KiB (232448 bytes). What a kernel asks for grows with
#   * the element size of its tiles (fp32 = 2x bf16; fp32 dots run as 3xTF32, which keeps a
#     high and a low tf32 part of every operand: ~4x the bf16 footprint),
#   * the padded head sizes K, V (the [BT, K] tiles of q, k, w, dq, dk and the [K, BV] state),
#   * BT (the [BT, K] tiles and the [BT, BT] decay / WY tiles),
#   * num_stages (software pipelining keeps num_stages copies of the loads of a loop).
# Measured by compiling each kernel's Triton IR for sm_90 and reading its shared-memory size, at
# K=V=128 and 256 in bf16/fp16/fp32, gated and ungated; every entry below stays under ~200 KB
# there (the XLA-bundled Triton of the GPU asked for up to 1.2x the local figure, so that is
# the margin).
#
# Knobs per kernel:
#   BT           chunk length of every kernel of one call (64; 32 where 64 does not fit).
#   state        (BV, num_warps, num_stages) of the sequential forward state/output kernel.
#   dh           (BV, num_warps, num_stages) of the sequential backward dh kernel.
#   grads        (BV, num_warps) of the per-chunk gradient kernel (one stage: no loop to pipeline).
#   wy           (num_warps, num_stages) of the WY preparation kernel.
@dataclass(frozen=True)
class DeltaTiles:
    BT: int
    state: tuple      # (BV, num_warps, num_stages)
    dh: tuple         # (BV, num_warps, num_stages)
    grads: tuple      # (BV, num_warps)
    wy: tuple         # (num_warps, num_stages)


def delta_tiles(K: int, V: int, dtype) -> DeltaTiles:
    """Tiles for padded head sizes K, V (powers of two, 16..256) and q's dtype
    (bf16 / fp16 / fp32). Raises ValueError beyond K or V = 256."""
    if K > 256 or V > 256:
        raise ValueError(f"K, V: got ({K}, {V}) after padding, expected at most 256 "
                         f"(shared memory of one program)")
    fp32 = jnp.dtype(dtype) == jnp.float32
    big = max(K, V) > 128
    if not fp32:
        # the benchmark shape (H100, bf16, B=4 T=4096 H=16 K=V=128): state BV=64 / 8 warps was
        # fastest of six; WY prep 0.317 ms with 2 warps vs 0.536 (4) and 0.944 (8); grads
        # 64 / 4 warps: GDN fwd+bwd 4.088 ms vs 4.405 (64 / 8), 4.226 (128 / 8), 5.540 (32 / 8),
        # 9.863 (64 / 16) (RESULTS.md run 14, pallas_launch_sweep.py "tiles:grads=...")
        if not big:
            return DeltaTiles(BT=64, state=(64, 8, 2), dh=(64, 8, 2), grads=(64, 4),
                              wy=(2, 1))
        return DeltaTiles(BT=64, state=(32, 8, 1), dh=(32, 8, 1), grads=(32, 8), wy=(2, 1))
    if not big:
        return DeltaTiles(BT=32, state=(32, 4, 1), dh=(32, 4, 1), grads=(32, 4), wy=(4, 1))
    return DeltaTiles(BT=16, state=(16, 4, 1), dh=(16, 4, 1), grads=(16, 4), wy=(4, 1))
