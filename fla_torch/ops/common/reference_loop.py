"""Run a token-by-token recurrence per sequence (cu_seqlens) or over the whole batch.

Used by every family's reference.py. `step(t_inputs, S) -> (o_t, S_next)` works on one token
of all rows: tensors [R, HV, ...] and state S [R, HV, K, V]. No in-place ops, so autograd works.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def _run(inputs: Sequence[Optional[torch.Tensor]], S: torch.Tensor, step):
    T = next(x for x in inputs if x is not None).shape[1]
    outs = []
    for t in range(T):
        o_t, S = step([None if x is None else x[:, t] for x in inputs], S)
        outs.append(o_t)
    return outs, S


def run_recurrence(inputs: Sequence[Optional[torch.Tensor]], initial_state, cu_seqlens,
                   state_shape: tuple, V: int, step):
    """inputs: token-major tensors [B, T, HV, ...] (None entries are passed through as None).

    initial_state: None or [N, HV, K, V]. state_shape: (HV, K, V).
    Returns (o [B, T, HV, V], final_state [N, HV, K, V]), both in the state dtype.
    """
    ref = next(x for x in inputs if x is not None)
    dtype, device = ref.dtype, ref.device
    B, T = ref.shape[:2]

    def initial(rows: slice, count: int) -> torch.Tensor:
        if initial_state is None:
            return torch.zeros((count,) + tuple(state_shape), dtype=dtype, device=device)
        return initial_state[rows].to(dtype)

    if cu_seqlens is None:
        outs, S = _run(inputs, initial(slice(0, B), B), step)
        return torch.stack(outs, dim=1), S
    offsets = [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    outs, finals = [], []
    for n in range(len(offsets) - 1):
        lo, hi = offsets[n], offsets[n + 1]
        seq = [None if x is None else x[:, lo:hi] for x in inputs]
        S = initial(slice(n, n + 1), 1)
        if hi > lo:
            o_n, S = _run(seq, S, step)
            outs.extend(o_n)
        finals.append(S[0])
    o = torch.stack(outs, dim=1) if outs else torch.zeros((B, 0, state_shape[0], V),
                                                            dtype=dtype, device=device)
    return o, torch.stack(finals, dim=0)
