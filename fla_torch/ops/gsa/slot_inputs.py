"""GSA's operands in the compute dtype: the slot write weights and log-decays (FLA's additive
gate when g is None) and the key/value heads expanded to the query heads.

Shared by gsa/reference.py and gsa/chunked.py; `kernel_call` and `transposed` by the two
Triton kernels (gsa/triton_chunk.py, gsa/triton_recurrent.py).
"""
from __future__ import annotations

import torch

from ..common.kernel_alloc import contiguous
from ..common.qk_inputs import compute_dtype, expand_heads


def slot_gate(s: torch.Tensor, cu_seqlens=None):
    """s: [B, T, H, M] slot logits (compute dtype). Per sequence and slot, with
    z_t = logsumexp(s_1..s_t): returns (w = exp(s - z), g = z_{t-1} - z_t, 0 at a sequence's
    first token), both [B, T, H, M]."""
    if cu_seqlens is None:
        pieces = [s]
    else:
        offsets = [int(x) for x in cu_seqlens.detach().cpu().tolist()]
        pieces = s.split([b - a for a, b in zip(offsets[:-1], offsets[1:])], dim=1)
    ws, gs = [], []
    for x in pieces:
        if x.shape[1] == 0:
            ws.append(x)
            gs.append(x)
            continue
        z = x.logcumsumexp(1)
        ws.append((x - z).exp())
        gs.append(torch.cat([torch.zeros_like(z[:, :1]), z[:, :-1] - z[:, 1:]], dim=1))
    return torch.cat(ws, dim=1), torch.cat(gs, dim=1)


def gsa_operands(q, k, v, s, g, initial_state, cu_seqlens):
    """Cast to the compute dtype (fp32, fp64 for fp64 q), derive (s, g) when g is None, and
    expand k, v, s, g [B, T, H, *] and the state parts [N, H, *] to q's HQ heads.

    Returns (q, k, v, s, g, hk0, hv0, NG) with NG = HQ // H."""
    cd = compute_dtype(q)
    q, k, v, s = (x.to(cd) for x in (q, k, v, s))
    if g is None:
        s, g = slot_gate(s, cu_seqlens)
    else:
        g = g.to(cd)
    HQ, H = q.shape[2], k.shape[2]
    NG = HQ // H
    k, v, s, g = (expand_heads(x, HQ) for x in (k, v, s, g))
    hk0, hv0 = initial_state if initial_state is not None else (None, None)
    hk0, hv0 = (None if h is None else h.to(cd).repeat_interleave(NG, dim=1) for h in (hk0, hv0))
    return q, k, v, s, g, hk0, hv0, NG


def group_final(state: torch.Tensor, NG: int) -> torch.Tensor:
    """[N, HQ, ...] -> [N, H, ...]: the state of each key/value head (the same for every query
    head of its group)."""
    return state if NG == 1 else state[:, ::NG].contiguous()


def transposed(x):
    """[N, H, A, B] -> contiguous [N, H, B, A] (None stays None)."""
    return None if x is None else x.transpose(-1, -2).contiguous()


def kernel_call(apply, q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens):
    """A GSA Triton kernel's host side: the slot weights (FLA's additive gate when g is None,
    formed in fp32, weights rounded to q's dtype), k, v, s, g and the state parts expanded to
    q's HQ heads, then apply(q, k, v, s, g fp32, scale, hk0, hv0, output_final_state,
    cu_seqlens) -> (o, hk, hv); the final state returned per key/value head."""
    if g is None:
        w, g = slot_gate(s.float(), cu_seqlens)
        s = w.to(q.dtype)
    HQ, H = q.shape[2], k.shape[2]
    NG = HQ // H
    hk0, hv0 = initial_state if initial_state is not None else (None, None)
    if NG > 1:
        k, v, s, g = (x.repeat_interleave(NG, dim=2) for x in (k, v, s, g))
        hk0, hv0 = (None if x is None else x.repeat_interleave(NG, dim=1) for x in (hk0, hv0))
    o, hk, hv = apply(*(contiguous(x) for x in (q, k, v, s, g.float())), float(scale),
                      contiguous(hk0), contiguous(hv0), bool(output_final_state), cu_seqlens)
    if not output_final_state:
        return o, None
    return o, (group_final(hk, NG), group_final(hv, NG))
