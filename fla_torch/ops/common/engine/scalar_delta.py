"""The engine's scalar-gate delta rule (Triton, WY / UT transform): the stages in order, forward
and backward, for GATE_SCALAR (g [B, T, HV]: chunk_gated_delta_rule) and GATE_NONE (g None:
chunk_delta_rule). Kernels: scalar_wy_fwd.py, scalar_delta_fwd.py, scalar_delta_bwd.py,
scalar_wy_bwd.py (split products: split_dot.py); launch tiles: launch.delta_launch.

Forward (`delta_forward`): wy_fwd (16-row blocks) -> chunk_h -> chunk_o. Backward
(`delta_backward`; the forward's per-chunk states and vn are kept): dvn_local -> chunk_dh
(reverse) -> dqk -> wy_bwd (dg: chunk-local gate derivative, reverse cumsum inside each chunk;
see scalar_delta_bwd.py), then the group sum of dq, dk over value heads sharing a q/k head.
Inputs are read in place ([B, T, H, D]); the time axis is flattened so fixed-length batches and
cu_seqlens share one code path; per-chunk buffers and chunk-parallel grids use varlen.py's
slots (cdiv(T, 64) + N of them with cu_seqlens: no host sync).
"""
from __future__ import annotations


import torch
import triton

from ..kernel_alloc import alloc
from ..qk_inputs import group_sum
from ..triton_scalar_gate import dot_precision, fp32_dot_precision
from ..triton_seq_layout import seq_offsets
from .launch import delta_launch, delta_state_launch
from .scalar_delta_bwd import _chunk_dh_kernel, _dqk_kernel, _dvn_local_kernel
from .scalar_delta_fwd import BT, _chunk_h_kernel, _chunk_o_kernel
from .scalar_wy_bwd import _wy_bwd2_kernel
from .scalar_wy_fwd import _wy_fwd16_kernel
from .varlen import n_slots, search_steps

# Internal buffers (w, u, h, vn, dh) are in the input dtype, as FLA's. vn = u - w h cancels,
# yet u in the input dtype (half of fp32's chunk_h traffic) keeps the errors far below the
# tolerances (GPU parity of every case).


def _precisions(dtype):
    """(PREC for dots on operands in the input dtype, PREC32 for fp32-internal dots). The fp32
    internals (Tm, dA, dw, du) are multiplied fp32-accurately for every input dtype: with tf32
    products the delta rule's dbeta error on an H100 is 2.3e-2 in bf16 AND fp16, 40x the fp16
    tolerance."""
    return dot_precision(dtype), fp32_dot_precision()


def _slots(B, T, N, cu_seqlens):
    """Launch arguments of the chunk-parallel kernels (varlen.py's slots: no host sync):
    (number of slots, the slot search's step count, IS_VARLEN)."""
    varlen = cu_seqlens is not None
    return n_slots(B, T, N, BT, varlen), search_steps(N), varlen


def _fwd_states(k, w, u, gc_hi, gc_lo, has_g, h0, offsets, NT, N, varlen, output_final_state,
                PREC):
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    BK, BV, kw = delta_state_launch("chunk_h", K, V, k.dtype)
    h_buf = alloc((NT, HV, K, V), k.dtype, k.device)
    vn = alloc((B, T, HV, V), k.dtype, k.device)
    ht = alloc((N, HV, K, V), torch.float32, k.device) if output_final_state else None
    _chunk_h_kernel[(triton.cdiv(V, BV), N * HV)](
        k, w, u, gc_hi, gc_lo, h0 if h0 is not None else u, h_buf, vn,
        ht if ht is not None else u, offsets, T,
        H=H, HV=HV, K=K, V=V, BT=BT, IS_VARLEN=varlen, BK=BK, BV=BV, HAS_G=has_g,
        HAS_H0=h0 is not None, STORE_HT=ht is not None, PREC=PREC, **kw)
    return h_buf, vn, ht


def delta_forward(q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens):
    """q, k [B, T, H, K], v [B, T, HV, V] contiguous, one dtype; g [B, T, HV] fp32 or None
    (GATE_NONE); beta [B, T, HV] fp32; h0 [N, HV, K, V] fp32 or None. Returns (o [B, T, HV,
    V] in q's dtype, final state [N, HV, K, V] fp32 or None, saved: what delta_backward
    reads)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    g = g.contiguous() if g is not None else None
    h0 = h0.contiguous() if h0 is not None else None
    offsets = seq_offsets(B, T, cu_seqlens, dev)
    N = offsets.shape[0] - 1
    NT, steps, varlen = _slots(B, T, N, cu_seqlens)
    PREC, PREC32 = _precisions(q.dtype)
    # chunk-local gate cumsum, fp64-accurate as fp32 hi + lo (see load_gates)
    gc = alloc((2, B, T, HV), torch.float32, dev) if g is not None else None
    gc_hi, gc_lo = (gc[0], gc[1]) if gc is not None else (beta, beta)
    tm = alloc((B, T, HV, BT), torch.float32, dev)
    w = alloc((B, T, HV, K), q.dtype, dev)
    u = alloc((B, T, HV, V), q.dtype, dev)
    BK, BV, kw = delta_launch("wy_fwd", K, V, q.dtype)
    _wy_fwd16_kernel[(NT, HV)](
        k, v, g if g is not None else beta, beta, gc_hi, gc_lo, tm, w, u,
        offsets, N, steps, T, H=H, HV=HV, K=K, V=V, BT=BT, IS_VARLEN=varlen, BK=BK, BV=BV,
        HAS_G=g is not None, PREC=PREC, PREC32=PREC32, **kw)
    h_buf, vn, ht = _fwd_states(k, w, u, gc_hi, gc_lo, g is not None, h0, offsets, NT, N,
                                varlen, output_final_state, PREC)
    o = alloc((B, T, HV, V), q.dtype, dev)
    BK, BV, kw = delta_launch("chunk_o", K, V, q.dtype)
    _chunk_o_kernel[(triton.cdiv(V, BV), NT, HV)](
        q, k, vn, h_buf, gc_hi, gc_lo, o, offsets, N, steps, T, scale,
        H=H, HV=HV, K=K, V=V, BT=BT, IS_VARLEN=varlen, BK=BK, BV=BV, HAS_G=g is not None,
        PREC=PREC, **kw)
    # the states per chunk and vn are kept (the backward does not re-run chunk_h)
    saved = (q, k, v, beta, gc, tm, w, h_buf, vn, h0, offsets, cu_seqlens)
    return o, ht, saved


def delta_backward(saved, do, dht, scale):
    """(dq, dk, dv, dg or None, dbeta, dh0 or None) from delta_forward's `saved`, do [B, T,
    HV, V] and dht [N, HV, K, V] fp32 or None. dq, dk are summed over grouped value heads."""
    q, k, v, beta, gc, tm, w, h_buf, vn, h0, offsets, cu_seqlens = saved
    has_g = gc is not None
    B, T, H, K = q.shape
    N = offsets.shape[0] - 1
    NT, steps, varlen = _slots(B, T, N, cu_seqlens)
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    PREC, PREC32 = _precisions(q.dtype)
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    gc_hi, gc_lo = (gc[0], gc[1]) if gc is not None else (beta, beta)
    dvn = alloc((B, T, HV, V), torch.float32, dev)
    BK, BV, kw = delta_launch("dvn_local", K, V, q.dtype)
    _dvn_local_kernel[(triton.cdiv(V, BV), NT, HV)](
        q, k, do, gc_hi, gc_lo, dvn, offsets, N, steps, T, scale, H=H, HV=HV, K=K, V=V, BT=BT,
        IS_VARLEN=varlen, BK=BK, BV=BV, HAS_G=has_g, PREC=PREC, **kw)
    SK, SV, kw = delta_state_launch("chunk_dh", K, V, q.dtype)
    dh_buf = alloc((NT, HV, K, V), q.dtype, dev)
    dh0 = alloc((N, HV, K, V), torch.float32, dev) if h0 is not None else None
    _chunk_dh_kernel[(triton.cdiv(V, SV), N * HV)](
        q, k, w, do, gc_hi, gc_lo, dvn, dht if dht is not None else dvn,
        dh0 if dh0 is not None else dvn, dh_buf, offsets, T, scale,
        H=H, HV=HV, K=K, V=V, BT=BT, IS_VARLEN=varlen, BK=SK, BV=SV, HAS_G=has_g,
        HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, PREC=PREC, **kw)
    # dq and dk are final per value head when HV == H: written in the input dtype
    final_dt = q.dtype if HV == H else torch.float32
    dq = alloc((B, T, HV, K), final_dt, dev)
    dk_direct = alloc((B, T, HV, K), torch.float32, dev)
    dw = alloc((B, T, HV, K), torch.float32, dev)
    QK, BV, kw = delta_launch("dqk", K, V, q.dtype)
    NKB = triton.cdiv(K, QK)
    dgc = alloc((NKB, B, T, HV), torch.float32, dev) if has_g else None
    _dqk_kernel[(NKB, NT, HV)](
        q, k, do, vn, dvn, h_buf, dh_buf, gc_hi, gc_lo, dq, dk_direct, dw,
        dgc if dgc is not None else dw, offsets, N, steps, T, scale, B * T * HV,
        H=H, HV=HV, K=K, V=V, BT=BT, IS_VARLEN=varlen, BK=QK, BV=BV, HAS_G=has_g, PREC=PREC,
        **kw)
    dk = alloc((B, T, HV, K), final_dt, dev)
    dv = alloc((B, T, HV, V), v.dtype, dev)
    dbeta = alloc((B, T, HV), torch.float32, dev)
    dg = alloc((B, T, HV), torch.float32, dev) if has_g else None
    # fp16: the WY backward runs on fp32 copies of k and v with the fp32 configuration.
    # Its fp16-operand variant gave dbeta errors of 3.4e-2..5.3e-2 on the H100 (Triton
    # 3.6; bf16, fp32 and the CPU interpreter were right; dk/dv right): a Hopper
    # miscompile of the kind FLA works around in its WY backward (their #984).
    wy_dt = torch.float32 if q.dtype == torch.float16 else q.dtype
    k_wy, v_wy = (k.float(), v.float()) if wy_dt != q.dtype else (k, v)
    BK, BV, kw = delta_launch("wy_bwd", K, V, wy_dt)
    _wy_bwd2_kernel[(NT, HV)](
        k_wy, v_wy, beta, gc_hi, gc_lo, tm, dk_direct, dw, dvn, dgc if dgc is not None else dw,
        dk, dv, dbeta, dg if dg is not None else dbeta, offsets, N, steps, T, B * T * HV, H=H,
        HV=HV, K=K, V=V, BT=BT, IS_VARLEN=varlen, BK=BK, BV=BV, HAS_G=has_g, NKB=NKB,
        SPLIT=wy_dt != torch.float32, PREC=PREC32,
        PREC16=PREC if wy_dt == q.dtype else PREC32, **kw)
    if HV != H:
        dq = group_sum(dq, H).to(q.dtype)
        dk = group_sum(dk, H).to(k.dtype)
    return dq, dk, dv, dg, dbeta, dh0
