"""dg of a scalar log-decay gate from per-token terms: a reverse cumsum per sequence (Triton).

For a recurrence whose state is S_t = exp(G_t) X_t with G_t = sum_{s<=t} g_s, the log-decay
enters only through o_t (as exp(G_t) q_t) and the written values (as exp(-G_t) v_t), so

    dg_t = sum_{s >= t, same sequence} (q_s . dq_s - v_s . dv_s)  +  sum(dS_final * S_final)

with dq, dv the gradients of that value head. The kernels produce the per-token term
`dgt` [B*T, HV] fp32; this file turns it into dg.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reverse_cumsum_kernel(x, extra, y, offsets, HV: tl.constexpr, HAS_EXTRA: tl.constexpr,
                           BT: tl.constexpr):
    i_n, i_hv = tl.program_id(0), tl.program_id(1)
    bos = tl.load(offsets + i_n).to(tl.int64)
    eos = tl.load(offsets + i_n + 1).to(tl.int64)
    carry = 0.0
    if HAS_EXTRA:
        carry = tl.load(extra + i_n * HV + i_hv).to(tl.float32)
    n_chunks = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    for c in range(n_chunks):
        start = eos - (c + 1) * BT
        rows = start + o_t
        mask = rows >= bos
        b_x = tl.load(x + rows * HV + i_hv, mask=mask, other=0.0)
        total = tl.sum(b_x, axis=0)
        # reverse inclusive cumsum inside the block: total - exclusive prefix
        b_y = total - tl.cumsum(b_x, axis=0) + b_x + carry
        tl.store(y + rows * HV + i_hv, b_y, mask=mask)
        carry = carry + total


def sequence_reverse_cumsum(dgt: torch.Tensor, offsets: torch.Tensor,
                            extra: torch.Tensor | None) -> torch.Tensor:
    """dgt: [B*T, HV] fp32; offsets: [N+1] int32; extra: None or [N, HV] fp32 added to every
    token of sequence n. Returns [B*T, HV] fp32 reverse cumsums per sequence."""
    TT, HV = dgt.shape
    N = offsets.shape[0] - 1
    y = torch.full_like(dgt, float("nan"))
    _reverse_cumsum_kernel[(N, HV)](dgt, extra if extra is not None else dgt, y, offsets,
                                    HV=HV, HAS_EXTRA=extra is not None, BT=64)
    return y
