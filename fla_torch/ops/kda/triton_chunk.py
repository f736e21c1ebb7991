"""chunk_kda in Triton: the chunked delta rule with a per-key gate, forward and backward as one
torch.autograd.Function on the chunk engine (fla_torch/ops/common/engine).

With b the in-chunk cumsum of g (per key channel) and `last` its value at the chunk's end, per
chunk of 64 tokens and value head (h: the state before the chunk):
    Aqk_ij = sum_c q_ic k_jc exp(b_ic - b_jc) (j <= i),  Ak_ij likewise on (k, k) (j < i)
    T = (I + diag(beta) Ak)^-1,  w = T diag(beta) (k exp(b)),  u = T diag(beta) v
    vn = u - w h,  h_next = diag(exp(last)) h + (k exp(last - b))^T vn
    o = scale ((q exp(b)) h + Aqk vn)
Stages: gates.chunk_cumsum, delta_scores.delta_scores (Aqk and Ak in one pass), wy.wy_fwd,
delta_state.delta_state_fwd, output_stage.output_fwd. Backward: delta_state.delta_state_bwd
(dh, dvn, dh0), wy.wy_bwd (dv, dbeta, the gradient of k exp(b), the score gradients dAk and
dAqk), delta_bwd.delta_output_bwd (dq, dk, dg).
fp16: k exp(b), q exp(b) (for the state pass) and w are kept relative to the chunk's first row
and exp(b_0) is applied in fp32 (`rel` of delta_scores; exp(b) of strong gates is subnormal in
fp16). The fp16 WY backward runs on fp32 copies (a Triton 3.6 Hopper miscompile, see DESIGN.md).
Grouped heads: q and k are repeated to the HV value heads (their gradients summed back by
autograd). use_qk_l2norm_in_kernel: q, k normalised by common/triton_l2norm.py first.
"""
from __future__ import annotations

import torch

from ..common.engine import GATE_KEY, chunk_cumsum, output_fwd
from ..common.engine.delta_bwd import delta_output_bwd
from ..common.engine.delta_scores import delta_scores
from ..common.engine.delta_state import delta_state_bwd, delta_state_fwd
from ..common.engine.launch import block
from ..common.engine.wy import BT, wy_bwd, wy_fwd
from ..common.kernel_alloc import alloc_on, contiguous as _contig
from ..common.qk_inputs import expand_heads
from ..common.triton_l2norm import l2norm_triton
from ..common.triton_scalar_gate import dot_precision, fp32_dot_precision

_GATE = GATE_KEY.value
MAX_HEAD_DIM = 256


class _ChunkKDA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens):
        alloc = alloc_on(q.device)
        prec, prec32 = dot_precision(q.dtype), fp32_dot_precision()
        # key blocks of 32 (H100 bf16 K128: 276 us; 64: 288 us, 16: 421 us)
        cum, kg, el = chunk_cumsum(g, k, _GATE, cu_seqlens, BT, block(k.shape[3], 32),
                                   alloc)
        # fp16: k exp(b), q exp(b) and w relative to the chunk's first row (strong gates make
        # exp(b) subnormal in fp16; dh0 lost accuracy), exp(b_0) applied in fp32 (e0)
        rel = q.dtype == torch.float16
        Aqk, Ak, qg, kb, qgr, e0 = delta_scores(q, k, cum, cu_seqlens, prec, alloc, rel=rel)
        Tm, w, u = wy_fwd(Ak, kb, v, beta, cu_seqlens, prec, prec32, alloc)
        h, vn, ht = delta_state_fwd(kg, w, u, el, h0, output_final_state, cu_seqlens, prec,
                                    alloc, e0=e0)
        o = output_fwd(qg, vn, h, Aqk, scale, cu_seqlens, prec, alloc)
        ctx.save_for_backward(q, k, v, beta, cum[0], cum[1], kg, el, Aqk,
                              qgr if rel else qg, Ak, kb, Tm, w, h, vn, e0, cu_seqlens)
        ctx.scale, ctx.has_h0 = scale, h0 is not None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, ch, cl, kg, el, Aqk, qg, Ak, kb, Tm, w, h, vn, e0, cu_seqlens = \
            ctx.saved_tensors
        alloc = alloc_on(q.device)
        prec, prec32 = dot_precision(q.dtype), fp32_dot_precision()
        do, dht = do.contiguous(), _contig(dht)
        scale = ctx.scale
        dh, dvn, dh0 = delta_state_bwd(qg, kg, w, Aqk, el, do, dht, scale, cu_seqlens,
                                       ctx.has_h0, prec, alloc, e0=e0)
        if q.dtype == torch.float16:
            # fp32 copies: the fp16-operand WY backward is miscompiled on Hopper by Triton 3.6
            # (see the gated delta rule's; DESIGN.md)
            wy_in = [x.float() for x in (k, kb, v, h, vn, do)]
            wy_prec = prec32
        else:
            wy_in, wy_prec = (k, kb, v, h, vn, do), prec
        k_w, kb_w, v_w, h_w, vn_w, do_w = wy_in
        dv, dbeta, dkb, dAk, dAqk = wy_bwd(k_w, kb_w, v_w, beta, Tm, Ak, h_w, dvn, vn_w, do_w,
                                           scale, cu_seqlens, wy_prec, prec32, alloc,
                                           dv_dtype=v.dtype, e0=e0)
        dq, dk, dg = delta_output_bwd(q, k, vn, do, h, dh, (ch, cl), dAqk, dAk, dkb, scale,
                                      cu_seqlens, prec, alloc, rel=e0 is not None)
        return dq, dk, dv, dg, dbeta, None, dh0, None, None


def chunk_kda_triton(q, k, v, *, g, beta, scale, initial_state, output_final_state,
                     cu_seqlens, use_qk_l2norm_in_kernel):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0), one dtype in bf16/fp16/fp32;
    g: [B, T, HV, K] fp32; beta: [B, T, HV] fp32; initial_state: None or [N, HV, K, V] fp32;
    cu_seqlens: None or [N+1] int (B == 1). Returns (o [B, T, HV, V] in q's dtype,
    final_state [N, HV, K, V] fp32 or None). K, V <= 256."""
    for name, size in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if size > MAX_HEAD_DIM:
            raise ValueError(f"chunk_kda(impl='triton'): head size {name}={size}; "
                             f"expected {name} <= {MAX_HEAD_DIM}")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_triton(q), l2norm_triton(k)
    HV = v.shape[2]
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    return _ChunkKDA.apply(_contig(q), _contig(k), _contig(v), _contig(g), _contig(beta),
                           float(scale), _contig(initial_state), bool(output_final_state),
                           cu_seqlens)
