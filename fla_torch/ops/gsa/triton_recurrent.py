"""Token-by-token Gated Slot Attention in Triton: GLA's recurrent kernels
(fla_torch/ops/gla/triton_recurrent.py) composed as in gsa/triton_chunk.py.

The value pass is recurrent GLA (q = softmax(ok), k = s, v, gate g, scale 1). The slot pass
(gate on the slot side) is the adjoint of recurrent GLA F with keys s, values k, states hk^T:
ok = dQ of F for the cotangent q; its backward is F forward (dq = o of F(Q = dok)) and F
backward with cotangent q ((ds, dk, dg, dhk0^T) = (dK, dV, dg, dh0)).
"""
from __future__ import annotations

import torch

from ..common.kernel_alloc import contiguous as _contig
from ..gla.triton_recurrent import recurrent_bwd, recurrent_fwd
from .slot_inputs import kernel_call, transposed as _t



class _RecurrentGSA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, s, g, scale, hk0, hv0, output_final_state, cu_seqlens):
        hk0t = _t(hk0)
        hkt_t = None
        if output_final_state:
            _, hkt_t = recurrent_fwd(s, s, k, g, scale, hk0t, True, cu_seqlens)
        ok, _, _, _, _ = recurrent_bwd(s, s, k, g, scale, hk0t, cu_seqlens, q, None, False)
        p32 = torch.softmax(ok.float(), dim=-1)
        p = p32.to(q.dtype)
        o, hvt = recurrent_fwd(p, s, v, g, 1.0, hv0, output_final_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, s, g, hk0t, hv0, cu_seqlens, p32, p)
        ctx.scale = scale
        return o, _t(hkt_t), hvt

    @staticmethod
    def backward(ctx, do, dhkt, dhvt):
        q, k, v, s, g, hk0t, hv0, cu_seqlens, p32, p = ctx.saved_tensors
        scale = ctx.scale
        dp, ds2, dv, dg2, dhv0 = recurrent_bwd(p, s, v, g, 1.0, hv0, cu_seqlens, do.contiguous(),
                                               _contig(dhvt), True)
        dp = dp.float()
        dok = (p32 * (dp - (p32 * dp).sum(-1, keepdim=True))).to(q.dtype)
        dq, _ = recurrent_fwd(dok, s, k, g, scale, hk0t, False, cu_seqlens)
        _, ds1, dk, dg1, dhk0t = recurrent_bwd(dok, s, k, g, scale, hk0t, cu_seqlens, q,
                                               _t(dhkt), True)
        ds = (ds1.float() + ds2.float()).to(s.dtype)
        return dq, dk, dv, ds, dg1 + dg2, None, _t(dhk0t), dhv0, None, None


def fused_recurrent_gsa_triton(q, k, v, s, *, g=None, scale=1.0, initial_state=None,
                               output_final_state=False, cu_seqlens=None):
    """Token-by-token GSA (Triton). Arguments and returns as
    gsa.triton_chunk.chunk_gsa_triton."""
    return kernel_call(_RecurrentGSA.apply, q, k, v, s, g, scale, initial_state,
                       output_final_state, cu_seqlens)
