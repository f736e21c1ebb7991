"""Token-by-token gated delta rule in Triton, forward AND backward (torch.autograd.Function).

Per sequence and value head hv (q/k head hv // (HV // H)), state S [K, V] fp32 in registers:
    S' = exp(g_t) S_{t-1};  w_t = v_t - k_t S';  S_t = S' + k_t^T (beta_t w_t);  o_t = scale q_t S_t
One program per (value block of BV columns, sequence x value head); columns of S are
independent, so reductions over K stay inside a program.

Backward (three sweeps, each one program per (value block, sequence x value head)):
  forward (in the forward pass): w_t = v_t - k_t S' stored fp32 when a gradient is needed;
  reverse: X = dS carried from the later tokens (exp(g_{t+1}) dS'_{t+1}, or dS_final), then
           dS_t = X + scale q_t^T do_t gives dv, dbeta, the dS.(beta w) part of dk, and
           du_t = -beta_t dS_t^T k_t, then dS_{t-1} = exp(g_t) (dS_t + k_t du_t);  dh0 = dS_0;
           gate term B_t = beta_t v_t . (k_t X);
  forward: S' du_t (rest of dk), dq_t = scale S' do_t + scale beta_t (w_t . do_t) k_t, and
           dg_t = c_t with c_1 = <h0, dh0>, c_{t+1} = c_t + B_t - A_t,
           A_t = scale (q_t S' do_t - beta_t (q_t . k_t)(k_t S' do_t)).
  dg_t = <dS'_t, S'_t> obeys c_{t+1} = c_t - (q.dq - v.dv)_t; q.dq and v.dv share the term
  scale beta (q.k)(v.do), O(1), which cancels (leaving A_t and B_t, both O(exp(g)) small under
  strong decay): the kernels never form it. Walking forward from <h0, dh0> (small) rather than
  backward from <dS_final, S_final> (O(1), cancelled by the last token's B) avoids the other
  cancellation. Partial sums over value blocks (dq, dk, dbeta, dg) are stored per block and
  summed.
With g=None this is the (ungated) delta rule.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.kernel_alloc import alloc
from ..common.qk_inputs import group_sum
from ..common.triton_seq_layout import seq_offsets

L2_EPS = 1e-6


@triton.jit
def _load_qk(ptr, o_k, mask_k, L2NORM: tl.constexpr):
    x = tl.load(ptr + o_k, mask=mask_k, other=0.0).to(tl.float32)
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)
    return x


@triton.jit
def _fwd_kernel(q, k, v, g, beta, h0, o, ht, w_buf, offsets, scale,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, HAS_H0: tl.constexpr,
                STORE_HT: tl.constexpr, STORE_W: tl.constexpr, L2NORM: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(offsets + i_n).to(tl.int64)
    eos = tl.load(offsets + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    p_state = (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + p_state, mask=mask_kv, other=0.0)
    for t in range(bos, eos):
        b_q = _load_qk(q + (t * H + i_h) * K, o_k, mask_k, L2NORM)
        b_k = _load_qk(k + (t * H + i_h) * K, o_k, mask_k, L2NORM)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv)
        if HAS_G:
            S = S * tl.exp(tl.load(g + t * HV + i_hv))
        b_w = b_v - tl.sum(S * b_k[:, None], axis=0)
        if STORE_W:
            tl.store(w_buf + (t * HV + i_hv) * V + o_v, b_w, mask=mask_v)
        S += b_k[:, None] * (b_beta * b_w)[None, :]
        b_o = tl.sum(S * b_q[:, None], axis=0) * scale
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if STORE_HT:
        tl.store(ht + p_state, S, mask=mask_kv)


@triton.jit
def _bwd_reverse_kernel(q, k, v, g, beta, w_buf, do, dht, dh0, dk_part, dv, dbeta_part,
                        du_buf, gate_part, offsets, scale, TT,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr,
                        HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, L2NORM: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(offsets + i_n).to(tl.int64)
    eos = tl.load(offsets + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    p_state = (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + p_state, mask=mask_kv, other=0.0)
    for r in range(0, eos - bos):
        t = eos - 1 - r
        b_q = _load_qk(q + (t * H + i_h) * K, o_k, mask_k, L2NORM)
        b_k = _load_qk(k + (t * H + i_h) * K, o_k, mask_k, L2NORM)
        b_w = tl.load(w_buf + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0)
        b_do = tl.load(do + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv)
        b_xk = tl.sum(dS * b_k[:, None], axis=0)          # k_t X, X = dS before token t
        if HAS_G:
            b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
            tl.store(gate_part + i_v * TT + t * HV + i_hv, b_beta * tl.sum(b_v * b_xk, axis=0))
        dS += scale * b_q[:, None] * b_do[None, :]
        b_dvn = b_xk + (scale * tl.sum(b_q * b_k, axis=0)) * b_do
        b_dk = tl.sum(dS * (b_beta * b_w)[None, :], axis=1)
        tl.store(dk_part + (i_v * TT + t * HV + i_hv) * K + o_k, b_dk, mask=mask_k)
        tl.store(dv + (t * HV + i_hv) * V + o_v, (b_beta * b_dvn).to(dv.dtype.element_ty),
                 mask=mask_v)
        tl.store(dbeta_part + i_v * TT + t * HV + i_hv, tl.sum(b_dvn * b_w, axis=0))
        b_du = -b_beta * b_dvn
        tl.store(du_buf + (t * HV + i_hv) * V + o_v, b_du, mask=mask_v)
        dS += b_k[:, None] * b_du[None, :]
        if HAS_G:
            dS = dS * tl.exp(tl.load(g + t * HV + i_hv))
    if STORE_DH0:
        tl.store(dh0 + p_state, dS, mask=mask_kv)


@triton.jit
def _bwd_forward_kernel(q, k, g, beta, h0, dh0, w_buf, du_buf, do, dq_part, dk_part, gate_part,
                        offsets, scale, TT,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr,
                        HAS_H0: tl.constexpr, L2NORM: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(offsets + i_n).to(tl.int64)
    eos = tl.load(offsets + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    p_state = (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    c = 0.0                                  # dg carry: <dS'_t, S'_t> (this block's share)
    if HAS_H0:
        S += tl.load(h0 + p_state, mask=mask_kv, other=0.0)
        if HAS_G:
            c = tl.sum(tl.sum(S * tl.load(dh0 + p_state, mask=mask_kv, other=0.0), axis=1),
                       axis=0)
    for t in range(bos, eos):
        b_q = _load_qk(q + (t * H + i_h) * K, o_k, mask_k, L2NORM)
        b_k = _load_qk(k + (t * H + i_h) * K, o_k, mask_k, L2NORM)
        b_w = tl.load(w_buf + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0)
        b_du = tl.load(du_buf + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0)
        b_do = tl.load(do + (t * HV + i_hv) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv)
        if HAS_G:
            S = S * tl.exp(tl.load(g + t * HV + i_hv))
        p_dk = dk_part + (i_v * TT + t * HV + i_hv) * K + o_k
        b_dk = tl.load(p_dk, mask=mask_k, other=0.0) + tl.sum(S * b_du[None, :], axis=1)
        tl.store(p_dk, b_dk, mask=mask_k)
        b_sd = tl.sum(S * b_do[None, :], axis=1)          # S' do_t
        if HAS_G:
            b_a = scale * (tl.sum(b_q * b_sd, axis=0)
                           - b_beta * tl.sum(b_q * b_k, axis=0) * tl.sum(b_k * b_sd, axis=0))
            p_gate = gate_part + i_v * TT + t * HV + i_hv
            b_b = tl.load(p_gate)                           # B_t from the reverse sweep
            tl.store(p_gate, c)
            c = c + b_b - b_a
        b_dq = scale * (b_sd + (b_beta * tl.sum(b_w * b_do, axis=0)) * b_k)
        S += b_k[:, None] * (b_beta * b_w)[None, :]
        tl.store(dq_part + (i_v * TT + t * HV + i_hv) * K + o_k, b_dq, mask=mask_k)


def _blocks(K: int, V: int):
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32 if BK <= 128 else 16)
    return BK, BV, triton.cdiv(V, BV)


def l2norm_backward(x: torch.Tensor, dy: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """Gradient of y = x / sqrt(sum(x^2) + eps) over the last axis; x raw, dy fp32."""
    xf = x.float()
    rn = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)
    y = xf * rn
    return (dy - y * (y * dy).sum(-1, keepdim=True)) * rn


class FusedRecurrentGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens, l2norm):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        offsets = seq_offsets(B, T, cu_seqlens, q.device)
        N = offsets.shape[0] - 1
        BK, BV, NV = _blocks(K, V)
        q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
        g = g.contiguous() if g is not None else None
        needs_grad = any(ctx.needs_input_grad[:6])
        # every element is written by the kernel (NaN-filled off the GPU: kernel_alloc)
        o = alloc((B, T, HV, V), q.dtype, q.device)
        ht = alloc((N, HV, K, V), torch.float32, q.device) if output_final_state else None
        w_buf = alloc((B, T, HV, V), torch.float32, q.device) if needs_grad else None
        _fwd_kernel[(NV, N * HV)](
            q, k, v, g if g is not None else beta, beta, h0 if h0 is not None else o, o,
            ht if ht is not None else o, w_buf if w_buf is not None else o, offsets, scale,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, HAS_G=g is not None, HAS_H0=h0 is not None,
            STORE_HT=ht is not None, STORE_W=w_buf is not None, L2NORM=l2norm)
        ctx.save_for_backward(q, k, v, g, beta, h0, w_buf, offsets)
        ctx.scale, ctx.l2norm = scale, l2norm
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, w_buf, offsets = ctx.saved_tensors
        scale, l2norm = ctx.scale, ctx.l2norm
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        N = offsets.shape[0] - 1
        TT = B * T * HV
        BK, BV, NV = _blocks(K, V)
        dev = q.device
        do = do.contiguous()
        f32 = torch.float32
        dk_part = alloc((NV, B, T, HV, K), f32, dev)
        dq_part = alloc((NV, B, T, HV, K), f32, dev)
        dbeta_part = alloc((NV, B, T, HV), f32, dev)
        gate_part = (alloc((NV, B, T, HV), f32, dev)
                     if g is not None else None)
        du_buf = alloc((B, T, HV, V), f32, dev)
        dv = alloc((B, T, HV, V), f32, dev)
        dh0 = alloc((N, HV, K, V), f32, dev) \
            if h0 is not None else None
        if dht is not None:
            dht = dht.contiguous()
        _bwd_reverse_kernel[(NV, N * HV)](
            q, k, v, g if g is not None else beta, beta, w_buf, do,
            dht if dht is not None else dv, dh0 if dh0 is not None else dv, dk_part, dv,
            dbeta_part, du_buf, gate_part if gate_part is not None else dbeta_part, offsets,
            scale, TT,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, HAS_G=g is not None, HAS_DHT=dht is not None,
            STORE_DH0=dh0 is not None, L2NORM=l2norm)
        _bwd_forward_kernel[(NV, N * HV)](
            q, k, g if g is not None else beta, beta, h0 if h0 is not None else dv,
            dh0 if dh0 is not None else dv, w_buf, du_buf, do, dq_part, dk_part,
            gate_part if gate_part is not None else dbeta_part, offsets, scale, TT,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, HAS_G=g is not None, HAS_H0=h0 is not None,
            L2NORM=l2norm)
        dq = group_sum(dq_part.sum(0), H)
        dk = group_sum(dk_part.sum(0), H)
        dbeta = dbeta_part.sum(0)
        dg = gate_part.sum(0) if g is not None else None
        if l2norm:
            dq = l2norm_backward(q, dq)
            dk = l2norm_backward(k, dk)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, dbeta, dh0,
                None, None, None, None)


def fused_recurrent_gated_delta_rule_triton(q, k, v, *, g, beta, scale, initial_state,
                                            output_final_state, cu_seqlens,
                                            use_qk_l2norm_in_kernel):
    """q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0), one dtype in bf16/fp16/fp32;
    g (None = delta rule), beta: [B, T, HV] fp32; initial_state: None or [N, HV, K, V] fp32;
    cu_seqlens: None or [N+1] int (B == 1). Returns (o [B, T, HV, V] in q's dtype,
    final_state [N, HV, K, V] fp32 or None)."""
    return FusedRecurrentGatedDeltaRule.apply(q, k, v, g, beta, initial_state, float(scale),
                                              bool(output_final_state), cu_seqlens,
                                              bool(use_qk_l2norm_in_kernel))
