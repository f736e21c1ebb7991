"""Launch configuration of every engine kernel: a frozen dataclass and one heuristic.

Tiles are sized from K, V and the dtype so that each kernel fits the H100's shared memory
(~227 KiB per block) in every dtype; fp32 tiles run with num_stages=1. Warps and stages of the
16-bit forward kernels as timed on the H100 (bf16, K = V = 128).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

KERNELS = ("cumsum", "cumsum_scores", "state_fwd", "state_bwd", "scores", "output_fwd",
           "output_bwd_dv", "output_bwd_intra", "output_bwd_inter")


@dataclass(frozen=True)
class LaunchConfig:
    """BT: chunk length; BC: sub-chunk length of the key-gate intra-chunk scores;
    BK, BV: key / value tile widths; maxnreg: register cap per thread (None: the compiler's)."""
    BT: int = 64
    BC: int = 16
    BK: int = 64
    BV: int = 64
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None

    def meta(self) -> dict:
        return {"BT": self.BT, "BC": self.BC, "BK": self.BK, "BV": self.BV,
                "num_warps": self.num_warps, "num_stages": self.num_stages}


def block(size: int, cap: int = 256) -> int:
    """Smallest power of two >= max(size, 16), at most cap."""
    return min(max(16, 1 << (int(size) - 1).bit_length()), cap)


@functools.lru_cache(maxsize=None)
def launch_for(kernel: str, K: int, V: int, dtype: torch.dtype,
               capability: tuple | None = None) -> LaunchConfig:
    """The configuration of `kernel` (one of KERNELS) for head sizes K, V and q's dtype."""
    if kernel not in KERNELS:
        raise ValueError(f"launch_for: kernel={kernel!r}; expected one of {KERNELS}")
    wide = dtype == torch.float32
    stages = 1 if wide else 2
    BK, BV = min(block(K), 64), min(block(V), 64)
    warps = 4
    if kernel in ("output_fwd", "output_bwd_dv", "output_bwd_inter", "output_bwd_intra"):
        BK = min(block(K), 32 if wide else 64)
        BV = min(block(V), 32 if wide else 64)
    if kernel == "output_fwd" and not wide:
        BV = min(block(V), 128)
    if kernel in ("output_bwd_dv", "output_bwd_inter") and (wide or BV > 64):
        warps = 8
    if kernel == "output_fwd" and wide:
        warps = 8
    if kernel in ("state_fwd", "state_bwd") and not wide:
        stages = 3          # loads of the next chunks in flight while the state updates
    if kernel == "cumsum_scores":     # [BT, BK] fp64 cumsum tiles and a [BT, BT] score tile
        BK = min(block(K), 16 if wide else 32)
    return LaunchConfig(BT=64, BC=16, BK=BK, BV=BV, num_warps=warps, num_stages=stages)
