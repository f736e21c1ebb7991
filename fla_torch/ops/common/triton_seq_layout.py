"""Sequence and chunk tables shared by the delta-rule Triton kernels (host side, torch only).

Every kernel sees the time axis flattened to B*T tokens ([B, T, H, D] read in place as
[B*T, H, D]). A batch without cu_seqlens is B sequences of length T, so one code path handles
both: `offsets` [N+1] int32 token offsets, and for chunked kernels `chunk_table` [NT, 2] int32
(sequence n, chunk index inside n) plus `chunk_offsets` [N+1] int32 (first global chunk of n).
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


def _make_chunk_tables(B: int, T: int, chunk: int, device: torch.device):
    nt = -(-T // chunk)
    n = torch.arange(B, dtype=torch.int32).repeat_interleave(nt)
    i = torch.arange(nt, dtype=torch.int32).repeat(B)
    offs = torch.arange(0, (B + 1) * nt, nt, dtype=torch.int32)
    table = torch.stack([n, i], dim=1).contiguous().to(device)
    return table, offs.to(device), int(table.shape[0])


_batch_chunk_tables = functools.lru_cache(maxsize=256)(_make_chunk_tables)


def chunk_tables(B: int, T: int, cu_seqlens, chunk: int, device):
    """Returns (chunk_table [NT, 2] int32, chunk_offsets [N+1] int32, NT) for chunk size `chunk`.

    chunk_table[c] = (n, i): global chunk c is the i-th chunk of sequence n. Needs the
    sequence lengths on the host when cu_seqlens is given (one device sync), as FLA does.
    Without cu_seqlens the tables of a (B, T, chunk, device) are made once and reused (the
    kernels only read them): no host-to-device copy per call.
    """
    if cu_seqlens is None:
        device = torch.device(device)
        if _capturing(device):
            return _make_chunk_tables(B, T, chunk, device)
        return _batch_chunk_tables(B, T, chunk, device)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).detach().cpu().long()
    counts = (lens + chunk - 1) // chunk
    n = torch.arange(len(lens), dtype=torch.int32).repeat_interleave(counts)
    starts = torch.cumsum(counts, 0) - counts
    i = (torch.arange(int(counts.sum()), dtype=torch.int64)
         - starts.repeat_interleave(counts)).to(torch.int32)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)]).to(
        torch.int32)
    table = torch.stack([n, i], dim=1).contiguous().to(device)
    return table, offs.to(device), int(table.shape[0])
