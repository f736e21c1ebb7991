"""Chunked gated delta rule in Triton (WY / UT transform), forward and backward as one
torch.autograd.Function. Kernels: triton_chunk_fwd.py, triton_wy_fwd.py, triton_chunk_bwd.py,
triton_wy_bwd.py.

Forward: wy_fwd (triton_wy_fwd.py, 16-row blocks) -> chunk_h -> chunk_o.  Backward (the
forward's per-chunk states and vn are kept): dvn_local -> chunk_dh (reverse) -> dqk ->
wy_bwd (triton_wy_bwd.py) (dg: chunk-local gate derivative, reverse
cumsum inside each chunk; see triton_chunk_bwd.py), then the group sum of dq, dk over value
heads sharing a q/k head.
With g=None it is the (ungated) delta rule. Inputs are read in place ([B, T, H, D]); the time
axis is flattened so fixed-length batches and cu_seqlens share one code path.
use_qk_l2norm_in_kernel: q, k are normalised in fp32 by common/triton_l2norm.py (fused
forward and backward) and handed to the kernels in the input dtype.
"""
from __future__ import annotations


import torch
import triton

from ..common.kernel_alloc import alloc
from ..common.triton_l2norm import l2norm_triton
from ..common.triton_scalar_gate import block, dot_precision, fp32_dot_precision
from ..common.triton_seq_layout import chunk_tables, seq_offsets
from .triton_chunk_bwd import _chunk_dh_kernel, _dqk_kernel, _dvn_local_kernel
from .triton_wy_bwd import _wy_bwd2_kernel
from .triton_chunk_fwd import BT, _chunk_h_kernel, _chunk_o_kernel
from .triton_wy_fwd import _wy_fwd16_kernel
from .triton_recurrent import group_sum




# Internal buffers (w, u, h, vn, dh) are in the input dtype, as FLA's. vn = u - w h cancels,
# yet u in the input dtype (half of fp32's chunk_h traffic) keeps the errors far below the
# tolerances (GPU parity of every case).


def _precisions(dtype):
    """(PREC for dots on operands in the input dtype, PREC32 for fp32-internal dots). The fp32
    internals (Tm, dA, dw, du) are multiplied fp32-accurately for every input dtype: with tf32
    products the delta rule's dbeta error on an H100 is 2.3e-2 in bf16 AND fp16, 40x the fp16
    tolerance."""
    return dot_precision(dtype), fp32_dot_precision()


# Launch parameters per kernel: caps on the K / V tile sizes, num_warps, num_stages (H100,
# bf16 B4T4096 sweep). "BV32" / "stages32": the state kernels' value
# tile and pipeline depth for fp32 inputs or K > 128 (the larger tiles overflow the 227 KiB of
# shared memory with 3 stages: chunk_dh fp32 would need 256 KiB); "stages32" also applies to the
# other kernels for fp32 inputs (not yet re-timed on the GPU). The tuning script overrides
# entries of this table.
LAUNCH = {
    "wy_fwd": dict(BK=128, BV=128, num_warps=4, stages32=1),
    "chunk_h": dict(BV=64, BV32=32, num_warps=4, stages32=1),
    "chunk_o": dict(BK=64, BV=128, num_warps=8, stages32=1),
    "dvn_local": dict(BK=64, BV=128, num_warps=8, stages32=1),
    "chunk_dh": dict(BV=64, BV32=32, num_warps=4, stages32=1),
    "dqk": dict(BK=128, BV=64, num_warps=8, stages32=1),
    "wy_bwd": dict(BK=64, BV=64, num_warps=8, stages32=1),
}


def _launch_kw(cfg, wide):
    kw = {n: cfg[n] for n in ("num_warps", "num_stages") if n in cfg}
    if wide and "stages32" in cfg:
        kw["num_stages"] = cfg["stages32"]
    return kw


def _tiles(name, K, V, dtype):
    """(BK, BV, launch kwargs) of kernel `name` for head dims K, V and input dtype."""
    cfg = LAUNCH[name]
    kw = _launch_kw(cfg, dtype == torch.float32)
    return block(K, cfg.get("BK", 256)), block(V, cfg["BV"]), kw


def _state_blocks(name, K, V, dtype):
    """Tiles of the sequential state kernels: the whole K, a block of V."""
    cfg = LAUNCH[name]
    BK = block(K)
    wide = BK > 128 or dtype == torch.float32
    BV = cfg["BV32"] if wide else cfg["BV"]
    return BK, block(V, BV), _launch_kw(cfg, wide)


def _fwd_states(k, w, u, gc_hi, gc_lo, has_g, h0, offsets, chunk_offsets, NT, N,
                output_final_state, PREC):
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    BK, BV, kw = _state_blocks("chunk_h", K, V, k.dtype)
    h_buf = alloc((NT, HV, K, V), k.dtype, k.device)
    vn = alloc((B, T, HV, V), k.dtype, k.device)
    ht = alloc((N, HV, K, V), torch.float32, k.device) if output_final_state else None
    _chunk_h_kernel[(triton.cdiv(V, BV), N * HV)](
        k, w, u, gc_hi, gc_lo, h0 if h0 is not None else u, h_buf, vn,
        ht if ht is not None else u, offsets, chunk_offsets,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_G=has_g,
        HAS_H0=h0 is not None, STORE_HT=ht is not None, PREC=PREC, **kw)
    return h_buf, vn, ht


class ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        dev = q.device
        q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
        g = g.contiguous() if g is not None else None
        h0 = h0.contiguous() if h0 is not None else None
        offsets = seq_offsets(B, T, cu_seqlens, dev)
        table, chunk_offsets, NT = chunk_tables(B, T, cu_seqlens, BT, dev)
        N = offsets.shape[0] - 1
        PREC, PREC32 = _precisions(q.dtype)
        # chunk-local gate cumsum, fp64-accurate as fp32 hi + lo (see load_gates)
        gc = alloc((2, B, T, HV), torch.float32, dev) if g is not None else None
        gc_hi, gc_lo = (gc[0], gc[1]) if gc is not None else (beta, beta)
        tm = alloc((B, T, HV, BT), torch.float32, dev)
        w = alloc((B, T, HV, K), q.dtype, dev)
        u = alloc((B, T, HV, V), q.dtype, dev)
        BK, BV, kw = _tiles("wy_fwd", K, V, q.dtype)
        _wy_fwd16_kernel[(NT, HV)](
            k, v, g if g is not None else beta, beta, gc_hi, gc_lo, tm, w, u,
            table, offsets, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV,
            HAS_G=g is not None, PREC=PREC, PREC32=PREC32, **kw)
        h_buf, vn, ht = _fwd_states(k, w, u, gc_hi, gc_lo, g is not None, h0, offsets,
                                    chunk_offsets, NT, N, output_final_state, PREC)
        o = alloc((B, T, HV, V), q.dtype, dev)
        BK, BV, kw = _tiles("chunk_o", K, V, q.dtype)
        _chunk_o_kernel[(triton.cdiv(V, BV), NT, HV)](
            q, k, vn, h_buf, gc_hi, gc_lo, o, table, offsets, scale,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_G=g is not None, PREC=PREC, **kw)
        # the states per chunk and vn are kept (the backward does not re-run chunk_h)
        ctx.save_for_backward(q, k, v, beta, gc, tm, w, h_buf, vn, h0, offsets, table,
                              chunk_offsets)
        ctx.meta = (scale, NT, N, g is not None)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, gc, tm, w, h_buf, vn, h0, offsets, table, chunk_offsets = \
            ctx.saved_tensors
        scale, NT, N, has_g = ctx.meta
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        dev = q.device
        PREC, PREC32 = _precisions(q.dtype)
        do = do.contiguous()
        dht = dht.contiguous() if dht is not None else None
        gc_hi, gc_lo = (gc[0], gc[1]) if gc is not None else (beta, beta)
        dvn = alloc((B, T, HV, V), torch.float32, dev)
        BK, BV, kw = _tiles("dvn_local", K, V, q.dtype)
        _dvn_local_kernel[(triton.cdiv(V, BV), NT, HV)](
            q, k, do, gc_hi, gc_lo, dvn, table, offsets, scale, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK,
            BV=BV, HAS_G=has_g, PREC=PREC, **kw)
        SK, SV, kw = _state_blocks("chunk_dh", K, V, q.dtype)
        dh_buf = alloc((NT, HV, K, V), q.dtype, dev)
        dh0 = alloc((N, HV, K, V), torch.float32, dev) if h0 is not None else None
        _chunk_dh_kernel[(triton.cdiv(V, SV), N * HV)](
            q, k, w, do, gc_hi, gc_lo, dvn, dht if dht is not None else dvn,
            dh0 if dh0 is not None else dvn, dh_buf, offsets, chunk_offsets, scale,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=SK, BV=SV, HAS_G=has_g, HAS_DHT=dht is not None,
            STORE_DH0=dh0 is not None, PREC=PREC, **kw)
        # dq and dk are final per value head when HV == H: written in the input dtype
        final_dt = q.dtype if HV == H else torch.float32
        dq = alloc((B, T, HV, K), final_dt, dev)
        dk_direct = alloc((B, T, HV, K), torch.float32, dev)
        dw = alloc((B, T, HV, K), torch.float32, dev)
        QK, BV, kw = _tiles("dqk", K, V, q.dtype)
        NKB = triton.cdiv(K, QK)
        dgc = alloc((NKB, B, T, HV), torch.float32, dev) if has_g else None
        _dqk_kernel[(NKB, NT, HV)](
            q, k, do, vn, dvn, h_buf, dh_buf, gc_hi, gc_lo, dq, dk_direct, dw,
            dgc if dgc is not None else dw, table, offsets, scale, B * T * HV,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=QK, BV=BV, HAS_G=has_g, PREC=PREC, **kw)
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
        BK, BV, kw = _tiles("wy_bwd", K, V, wy_dt)
        _wy_bwd2_kernel[(NT, HV)](
            k_wy, v_wy, beta, gc_hi, gc_lo, tm, dk_direct, dw, dvn, dgc if dgc is not None else dw,
            dk, dv, dbeta, dg if dg is not None else dbeta, table, offsets, B * T * HV, H=H,
            HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_G=has_g, NKB=NKB,
            SPLIT=wy_dt != torch.float32, PREC=PREC32,
            PREC16=PREC if wy_dt == q.dtype else PREC32, **kw)
        if HV != H:
            dq = group_sum(dq, H).to(q.dtype)
            dk = group_sum(dk, H).to(k.dtype)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None


def chunk_gated_delta_rule_triton(q, k, v, *, g, beta, scale, initial_state, output_final_state,
                                  cu_seqlens, use_qk_l2norm_in_kernel):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0), one dtype in bf16/fp16/fp32;
    g (None = delta rule), beta: [B, T, HV] fp32; initial_state: None or [N, HV, K, V] fp32;
    cu_seqlens: None or [N+1] int (B == 1). Returns (o [B, T, HV, V] in q's dtype,
    final_state [N, HV, K, V] fp32 or None)."""
    if use_qk_l2norm_in_kernel:
        q = l2norm_triton(q)
        k = l2norm_triton(k)
    return ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, float(scale),
                                     bool(output_final_state), cu_seqlens)
