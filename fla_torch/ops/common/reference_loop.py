"""Run a token-by-token recurrence per sequence (cu_seqlens) or over the whole batch.

Used by every family's reference.py. `step(t_inputs, S) -> (o_t, S_next)` works on one token
of all rows: tensors [R, HV, ...] and state S [R, HV, K, V]. No in-place ops, so autograd works.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def _run(inputs: Sequence[Optional[torch.Tensor]], S: torch.Tensor, step):
    # unbind once: indexing x[:, t] per token would make autograd allocate a full-size
    # gradient per token (quadratic in T)
    per_token = [None if x is None else x.unbind(1) for x in inputs]
    T = next(len(x) for x in per_token if x is not None)
    outs = []
    for t in range(T):
        o_t, S = step([None if x is None else x[t] for x in per_token], S)
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

    if cu_seqlens is None:
        S = (torch.zeros((B,) + tuple(state_shape), dtype=dtype, device=device)
             if initial_state is None else initial_state.to(dtype))
        outs, S = _run(inputs, S, step)
        return torch.stack(outs, dim=1), S
    offsets = [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    lens = [offsets[n + 1] - offsets[n] for n in range(len(offsets) - 1)]
    # split once (not one slice per sequence, whose gradients would each be full-size)
    seqs = [None if x is None else x.split(lens, dim=1) for x in inputs]
    h0 = None if initial_state is None else initial_state.to(dtype).unbind(0)
    outs, finals = [], []
    for n, L in enumerate(lens):
        S = (torch.zeros((1,) + tuple(state_shape), dtype=dtype, device=device)
             if h0 is None else h0[n][None])
        if L > 0:
            o_n, S = _run([None if x is None else x[n] for x in seqs], S, step)
            outs.extend(o_n)
        finals.append(S[0])
    o = torch.stack(outs, dim=1) if outs else torch.zeros((B, 0, state_shape[0], V),
                                                            dtype=dtype, device=device)
    return o, torch.stack(finals, dim=0)
