"""Launch configuration of every engine kernel: a frozen dataclass and the heuristics.

`launch_for(kernel, K, V, dtype)`: the staged kernels (KERNELS). `scan_launch`: the scalar-gate
chunk scan (scan.py), sized also by the number of (sequence, head) pairs, since its programs
are serial over chunks. `delta_launch`: the scalar-gate delta-rule kernels (scalar_delta*.py,
scalar_wy*.py).

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


# Scalar-gate chunk scan (scan.py). H100 (bf16, B=4 T=4096 H=16 K=V=128): forward BV=64 /
# 4 warps / 3 stages 0.187 ms (BV=32: 0.196; 2 stages: 0.23; 8 warps: 0.23-0.48); backward
# BK=BV=64 / 4 warps / 2 stages 0.90 ms (8 warps 1.29; 32-wide blocks 1.12).
SM_TARGET = 128   # programs wanted in flight: the chunk loop inside a program is serial


def scan_launch(direction: str, K: int, V: int, n_heads: int, itemsize: int) -> LaunchConfig:
    """direction "fwd": one program per (sequence, head, BV block of V) with all of K;
    "bwd": per (sequence, head) cdiv(K, BK) dq + cdiv(K, BK) dk + cdiv(V, BV) dv programs, each
    with all of the other head dim. n_heads = N * H; itemsize of q's dtype."""
    KF, VF = block(K), block(V)
    big = KF > 128 or VF > 128
    if direction == "fwd":
        BV = 16
        for cand in ((64, 32) if KF <= 128 else (32,)):
            if n_heads * -(-V // cand) >= SM_TARGET:
                BV = cand
                break
        stages = (2 if big else 3) if itemsize == 2 else (1 if big else 2)
        return LaunchConfig(BT=64, BK=KF, BV=min(BV, VF), num_warps=4, num_stages=stages)
    if direction != "bwd":
        raise ValueError(f"scan_launch: direction={direction!r}; expected 'fwd' or 'bwd'")
    BK = min(64 if VF <= 128 else 32, KF)
    BV = min(64 if KF <= 128 else 32, VF)
    if n_heads * (2 * -(-K // BK) + -(-V // BV)) < SM_TARGET:
        BK, BV = min(BK, 32), min(BV, 32)
    return LaunchConfig(BT=64, BK=BK, BV=BV, num_warps=4,
                        num_stages=2 if (itemsize == 2 or not big) else 1)


# Scalar-gate delta rule (scalar_delta.py). Launch parameters per kernel: caps on the K / V
# tile sizes, num_warps, num_stages (H100, bf16 B4T4096 sweep). "BV32" / "stages32": the state
# kernels' value tile and pipeline depth for fp32 inputs or K > 128 (the larger tiles overflow
# the 227 KiB of shared memory with 3 stages: chunk_dh fp32 would need 256 KiB); "stages32"
# also applies to the other kernels for fp32 inputs. benchmarks/launch_sweep.py can vary any
# of these kernels' options (e.g. "scalar_delta_fwd._chunk_h_kernel:num_warps=8").
DELTA_LAUNCH = {
    "wy_fwd": dict(BK=128, BV=128, num_warps=4, stages32=1),
    "chunk_h": dict(BV=64, BV32=32, num_warps=4, stages32=1),
    "chunk_o": dict(BK=64, BV=128, num_warps=8, stages32=1),
    "dvn_local": dict(BK=64, BV=128, num_warps=8, stages32=1),
    "chunk_dh": dict(BV=64, BV32=32, num_warps=4, stages32=1, warps_k256=8),
    "dqk": dict(BK=128, BV=64, num_warps=8, stages32=1),
    "wy_bwd": dict(BK=64, BV=64, num_warps=8, stages32=1),
}


def _launch_kw(cfg, wide):
    kw = {n: cfg[n] for n in ("num_warps", "num_stages") if n in cfg}
    if wide and "stages32" in cfg:
        kw["num_stages"] = cfg["stages32"]
    return kw


def delta_launch(name: str, K: int, V: int, dtype: torch.dtype):
    """(BK, BV, launch kwargs) of kernel `name` for head dims K, V and input dtype."""
    cfg = DELTA_LAUNCH[name]
    kw = _launch_kw(cfg, dtype == torch.float32)
    return block(K, cfg.get("BK", 256)), block(V, cfg["BV"]), kw


def delta_state_launch(name: str, K: int, V: int, dtype: torch.dtype):
    """Tiles of the sequential state kernels: the whole K, a block of V."""
    cfg = DELTA_LAUNCH[name]
    BK = block(K)
    wide = BK > 128 or dtype == torch.float32
    BV = cfg["BV32"] if wide else cfg["BV"]
    kw = _launch_kw(cfg, wide)
    if BK > 128 and dtype != torch.float32 and "warps_k256" in cfg:
        # chunk_dh, K = 256, 16-bit, 4 warps: non-finite dh for the ungated delta rule on the
        # H100 (Triton 3.6; the CPU interpreter, fp32, the gated kernel and 8 warps were right;
        # BV 16 was not): RESULTS.md run 14
        kw["num_warps"] = cfg["warps_k256"]
    return BK, block(V, BV), kw
