"""Launch tiles of the chunked (gated) delta-rule Pallas kernels, picked from K, V and dtype.

Why a table: the Triton lowering stages every dot operand through shared memory, and an
H100 gives one program at most 227 KiB (232448 bytes). What a kernel asks for grows with
  * the element size of its tiles (fp32 = 2x bf16; fp32 dots run as 3xTF32, which keeps a
    high and a low tf32 part of every operand: ~4x the bf16 footprint),
  * the padded head sizes K, V (the [BT, K] tiles of q, k, w, dq, dk and the [K, BV] state),
  * BT (the [BT, K] tiles and the [BT, BT] decay / WY tiles),
  * num_stages (software pipelining keeps num_stages copies of the loads of a loop).
Measured by compiling each kernel's Triton IR for sm_90 and reading its shared-memory size, at
K=V=128 and 256 in bf16/fp16/fp32, gated and ungated; every entry below stays under ~200 KB there (the
XLA-bundled Triton of the GPU asked for up to 1.2x the local figure, so that is the margin).

Knobs per kernel:
  BT           chunk length of every kernel of one call (64; 32 where 64 does not fit).
  state        (BV, num_warps, num_stages) of the sequential forward state/output kernel.
  dh           (BV, num_warps, num_stages) of the sequential backward dh kernel.
  grads        (BV, num_warps) of the per-chunk gradient kernel (one stage: no loop to pipeline).
  wy           (num_warps, num_stages) of the WY preparation kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp


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
        # fastest of six; WY prep 0.317 ms with 2 warps vs 0.536 (4) and 0.944 (8)
        if not big:
            return DeltaTiles(BT=64, state=(64, 8, 2), dh=(64, 8, 2), grads=(64, 8),
                              wy=(2, 1))
        return DeltaTiles(BT=64, state=(32, 8, 1), dh=(32, 8, 1), grads=(32, 8), wy=(2, 1))
    if not big:
        return DeltaTiles(BT=32, state=(32, 4, 1), dh=(32, 4, 1), grads=(32, 4), wy=(4, 1))
    return DeltaTiles(BT=16, state=(16, 4, 1), dh=(16, 4, 1), grads=(16, 4), wy=(4, 1))
