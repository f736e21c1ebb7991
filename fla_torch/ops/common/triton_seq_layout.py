"""Sequence offsets shared by the Triton kernels (host side, torch only).

Every kernel sees the time axis flattened to B*T tokens ([B, T, H, D] read in place as
[B*T, H, D]). A batch without cu_seqlens is B sequences of length T, so one code path handles
both: `offsets` [N+1] int32 token offsets. Chunked kernels number their chunks by the engine's
slots (engine/varlen.py), found inside the kernels: no host sync.
"""
from __future__ import annotations

import functools

import torch


def seq_offsets(B: int, T: int, cu_seqlens, device) -> torch.Tensor:
    """[N+1] int32 token offsets into the flattened B*T axis (the kernels only read it; without
    cu_seqlens one tensor per (B, T, device) is made once and reused)."""
    if cu_seqlens is None:
        device = torch.device(device)
        if _capturing(device):
            return _make_offsets(B, T, device)
        return _batch_offsets(B, T, device)
    return cu_seqlens.to(device=device, dtype=torch.int32)


def _capturing(device: torch.device) -> bool:
    """A CUDA graph is being captured: what is made now lives in the graph's memory pool, so it
    is not kept for later calls."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _make_offsets(B: int, T: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)


_batch_offsets = functools.lru_cache(maxsize=256)(_make_offsets)
