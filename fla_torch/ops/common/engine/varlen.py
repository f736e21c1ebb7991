"""One varlen scheme for every engine kernel, with no host synchronisation.

Tokens are the flattened B*T axis ([B, T, H, D] read in place as [B*T, H, D]); sequence n is
rows [bos, eos) of it, from cu_seqlens (B == 1) or n*T. Per-chunk buffers (h, dh) have one slot
per chunk:
    non-varlen: slot = n * cdiv(T, BT) + c                 (B * cdiv(T, BT) slots)
    varlen:     slot = bos // BT + n + c                   (cdiv(T, BT) + N slots)
The varlen slots of different sequences never collide (the next sequence starts at
(bos + len) // BT + n + 1 >= bos // BT + n + cdiv(len, BT)); some slots belong to no chunk.
Chunk-parallel kernels run one program per slot and find (n, c) by a binary search over
cu_seqlens (`slot_chunk`); a slot of no chunk gets an empty token range.
"""
from __future__ import annotations

import triton
import triton.language as tl


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b) of two Python ints (plain arithmetic: no Triton call per launch)."""
    return -(-a // b)


def n_slots(B: int, T: int, N: int, BT: int, varlen: bool) -> int:
    """Number of per-chunk slots (see the module docstring)."""
    return cdiv(T, BT) + N if varlen else B * cdiv(T, BT)


def search_steps(N: int) -> int:
    """Binary-search steps that `slot_chunk` needs for N sequences."""
    return max(1, int(N).bit_length())


@triton.jit
def seq_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """First and one-past-last token (int64, flattened B*T axis) of sequence i_n."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def chunk_slot(i_n, bos, i_c, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Slot of chunk i_c of sequence i_n (int64)."""
    if IS_VARLEN:
        slot = bos // BT + i_n + i_c
    else:
        slot = i_n.to(tl.int64) * tl.cdiv(T, BT) + i_c
    return slot


@triton.jit
def slot_chunk(cu_seqlens, slot, N, n_steps, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Inverse of chunk_slot: (sequence, first token of the chunk, one-past-last token of the
    sequence). A slot of no chunk returns an empty range (chunk start == end)."""
    if IS_VARLEN:
        lo = slot * 0
        hi = lo + N
        for _ in range(n_steps):
            mid = (lo + hi) // 2
            start = tl.load(cu_seqlens + mid).to(tl.int64) // BT + mid
            go = start <= slot
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        i_n = lo
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = bos + (slot - (bos // BT + i_n)) * BT
        c0 = tl.minimum(c0, eos)
    else:
        NT = tl.cdiv(T, BT)
        i_n = slot // NT
        c0 = i_n.to(tl.int64) * T + (slot % NT) * BT
        eos = i_n.to(tl.int64) * T + T
    return i_n, c0, eos
