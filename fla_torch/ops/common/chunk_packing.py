"""Chunk-aligned layout for the chunked implementations, with or without cu_seqlens.

A `ChunkPlan` maps token-major tensors [B, T, H, ...] to chunk-major tensors
[R, H, NC, C, ...] (R rows, NC chunks of C tokens) and back:
- no cu_seqlens: R = B, each row is one sequence, zero-padded at the end to NC * C tokens;
- cu_seqlens: R = 1, every sequence is zero-padded to a multiple of C and the padded
  sequences are laid end to end, so no chunk holds tokens of two sequences. A sequence of
  length 0 owns no chunk.
Pad tokens are zeros (k = v = 0, g = 0, beta = 0), so they leave the state unchanged.
`starts[c]` names the sequences whose state resets (to initial_state) at chunk c and
`ends[c]` those whose final state is the state after chunk c.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ChunkPlan:
    chunk_size: int
    rows: int                      # R
    num_chunks: int                # NC
    T: int                         # tokens per row of the input
    num_seqs: int                  # N
    seq_lens: tuple                # length of each sequence
    starts: dict                   # chunk -> sequence index whose state starts there (varlen)
    ends: dict                     # chunk -> sequence index whose state ends there (varlen)
    src: Optional[torch.Tensor]    # varlen: [NC*C] token index feeding each packed slot
    src_valid: Optional[torch.Tensor]  # varlen: [NC*C] bool, False for pad slots
    dst: Optional[torch.Tensor]    # varlen: [T] packed slot of each token

    @property
    def varlen(self) -> bool:
        return self.src is not None


def make_plan(B: int, T: int, cu_seqlens: Optional[torch.Tensor], chunk_size: int,
              device=None) -> ChunkPlan:
    """Plan for q of shape [B, T, ...]; cu_seqlens: None or integer [N+1] (validated)."""
    C = chunk_size
    if cu_seqlens is None:
        nc = -(-T // C)
        return ChunkPlan(C, B, nc, T, B, (T,) * B, {}, {}, None, None, None)
    offsets = [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    lens = [offsets[n + 1] - offsets[n] for n in range(len(offsets) - 1)]
    src, valid, dst = [], [], []
    starts, ends = {}, {}
    chunk = 0
    for n, L in enumerate(lens):
        nc = -(-L // C)
        if nc == 0:
            continue
        starts[chunk] = n
        ends[chunk + nc - 1] = n
        base = len(src)
        dst.extend(range(base, base + L))
        src.extend(range(offsets[n], offsets[n] + L))
        valid.extend([True] * L)
        src.extend([0] * (nc * C - L))
        valid.extend([False] * (nc * C - L))
        chunk += nc
    device = cu_seqlens.device if device is None else device
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return ChunkPlan(C, 1, chunk, T, len(lens), tuple(lens), starts, ends, as_long(src),
                     torch.tensor(valid, dtype=torch.bool, device=device), as_long(dst))


def to_chunks(plan: ChunkPlan, x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, *rest] -> [R, H, NC, C, *rest], pad tokens zero."""
    C, NC = plan.chunk_size, plan.num_chunks
    if plan.varlen:
        x = x.index_select(1, plan.src)
        mask = plan.src_valid.view((1, -1) + (1,) * (x.dim() - 2))
        x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    elif NC * C != x.shape[1]:
        pad = torch.zeros((x.shape[0], NC * C - x.shape[1]) + tuple(x.shape[2:]),
                          dtype=x.dtype, device=x.device)
        x = torch.cat([x, pad], dim=1)
    R, H, rest = x.shape[0], x.shape[2], tuple(x.shape[3:])
    return x.reshape((R, NC, C, H) + rest).movedim(3, 1)


def from_chunks(plan: ChunkPlan, y: torch.Tensor) -> torch.Tensor:
    """[R, H, NC, C, *rest] -> [B, T, H, *rest] (pad tokens dropped)."""
    R, H, NC, C = y.shape[:4]
    rest = tuple(y.shape[4:])
    y = y.movedim(1, 3).reshape((R, NC * C, H) + rest)
    if plan.varlen:
        return y.index_select(1, plan.dst)
    return y[:, :plan.T]


def scan_chunks(plan: ChunkPlan, initial_state: Optional[torch.Tensor], state_shape: tuple,
                dtype: torch.dtype, device, step):
    """Carry the recurrent state across chunks, sequentially.

    state_shape: (HV, K, V). initial_state: None or [N, HV, K, V].
    step(c, S) -> (S_next, extra): S is the state entering chunk c, [R, HV, K, V].
    Returns (S_in [R, HV, NC, K, V] the state entering each chunk, extras (list per chunk),
    final_state [N, HV, K, V]).
    """
    # one view per sequence, unbound once (per-sequence slicing would make autograd allocate a
    # full-size gradient per sequence)
    h0 = None if initial_state is None else initial_state.to(dtype).unbind(0)

    def initial(n: int) -> torch.Tensor:
        """State entering sequence n (varlen), [1, HV, K, V]."""
        if h0 is None:
            return torch.zeros((1,) + tuple(state_shape), dtype=dtype, device=device)
        return h0[n][None]

    S = None
    if not plan.varlen:
        S = (torch.zeros((plan.rows,) + tuple(state_shape), dtype=dtype, device=device)
             if initial_state is None else initial_state.to(dtype))
    finals = [None] * plan.num_seqs
    states_in, extras = [], []
    for c in range(plan.num_chunks):
        if c in plan.starts:
            S = initial(plan.starts[c])
        states_in.append(S)
        S, extra = step(c, S)
        extras.append(extra)
        if c in plan.ends:
            finals[plan.ends[c]] = S[0]
    if plan.varlen:
        for n in range(plan.num_seqs):
            if finals[n] is None:  # zero-length sequence: its state is its initial state
                finals[n] = initial(n)[0]
        final = torch.stack(finals, dim=0)
    else:
        final = S
    if states_in:
        S_in = torch.stack(states_in, dim=2)
    else:
        S_in = torch.zeros((plan.rows, state_shape[0], 0) + tuple(state_shape[1:]),
                           dtype=dtype, device=device)
    return S_in, extras, final
