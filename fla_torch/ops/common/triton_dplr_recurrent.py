"""Token-by-token diagonal-plus-low-rank (DPLR) recurrence in Triton, forward and backward
stages shared by fused_recurrent_rwkv7 and fused_recurrent_kda (their autograd.Functions live
in ops/rwkv7/triton_recurrent.py and ops/kda/triton_recurrent.py).

Per sequence and value head, state S [K, V] fp32 in registers, d_t = exp(w_t) in R^K:
    S_t = diag(d_t) S_{t-1} + b_t (a_t^T S_{t-1}) + c_t v_t^T,   o_t = scale * q_t S_t
- RWKV-7 (KDA=False): a, b given, c = k.
- KDA (KDA=True), from k, g, beta: a = d * k, b = -beta k, c = beta k, computed as
  S' = diag(d) S_{t-1};  u_t = v_t - k_t^T S';  S_t = S' + beta_t k_t u_t^T.
The forward runs one program per (sequence x value head, block of BV value columns), K whole:
the columns of S are independent, so every reduction over K stays inside a program (V is
tiled). The backward handles the same items in a grid-stride loop over at most 4 programs per
SM, each with a scratch of BT states, so its memory does not grow with the number of
sequences.

Backward. The transition is not invertible (d down to exp(-20), rank-one updates), so the
forward keeps S at checkpoints (the state before every segment of BT tokens, only when a
gradient is needed; per-segment slots as in engine/varlen.py, no host sync). The backward
walks the segments in reverse: it recomputes the segment's states from its checkpoint into a
per-program scratch [BT, BK, BV] (forming dq_t = scale S_t do_t on the way), then walks the
segment in reverse with G = dL/dS_t (G_t = G from t+1 + scale q_t^T do_t), having S_{t-1} and G_t
together, so every gradient is a direct product (no running sums that cancel):
    dv_t = G^T c;  x_t = G^T b;  da_t = S_{t-1} x_t;  dw_t = d * rowsum(S_{t-1} o G)
    RWKV-7: dk_t = G v_t, db_t = G (S_{t-1}^T a_t)
    KDA:    y_t = G u_t;  dk_t = beta y_t + S' x_t;  dbeta_t = k_t . y_t;
            dg_t = rowsum(S' o (G + k x^T))
    G_{t-1} = diag(d) G + a x^T  (KDA: diag(d) (G + k x^T));  dh0 = G_0.
The gradients that sum over V are partial sums over value blocks, stored per block (fp32) and
summed on the host: parts [NV, NPART, B*T*HV, K] = RWKV-7 (dq, dk, db, da, dw), KDA (dq, dk, dg),
and KDA's dbeta [NV, B*T*HV].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .engine.varlen import chunk_slot, n_slots, seq_bounds
from .kernel_alloc import alloc

SEGMENT = 64          # tokens between checkpoints (and the backward's recompute length)


@triton.jit
def _vec(ptr, o, m):
    return tl.load(ptr + o, mask=m, other=0.).to(tl.float32)


@triton.jit
def _token(k, w, a, b, beta, t, i_h, i_hv, o_k, m_k, H: tl.constexpr, HV: tl.constexpr,
           K: tl.constexpr, KDA: tl.constexpr):
    """(k_t, d_t, a_t, b_t, c_t) of token t (fp32; KDA: a, b unused, c = beta k)."""
    b_k = _vec(k + (t * H + i_h) * K, o_k, m_k)
    b_d = tl.exp(_vec(w + (t * HV + i_hv) * K, o_k, m_k))
    if KDA:
        b_a = b_k
        b_b = b_k
        b_c = tl.load(beta + t * HV + i_hv).to(tl.float32) * b_k
    else:
        b_a = _vec(a + (t * HV + i_hv) * K, o_k, m_k)
        b_b = _vec(b + (t * HV + i_hv) * K, o_k, m_k)
        b_c = b_k
    return b_k, b_d, b_a, b_b, b_c


@triton.jit
def _advance(S, b_k, b_d, b_a, b_b, b_c, b_v, KDA: tl.constexpr):
    """S_{t-1} -> S_t."""
    if KDA:
        S = S * b_d[:, None]
        b_u = b_v - tl.sum(S * b_k[:, None], axis=0)
        S += b_c[:, None] * b_u[None, :]
    else:
        b_sa = tl.sum(S * b_a[:, None], axis=0)
        S = S * b_d[:, None] + b_b[:, None] * b_sa[None, :] + b_c[:, None] * b_v[None, :]
    return S


@triton.jit
def _fwd_kernel(q, k, v, w, a, b, beta, h0, o, ht, ckpt, cu_seqlens, scale, T,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, KDA: tl.constexpr,
                USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_CKPT: tl.constexpr,
                IS_VARLEN: tl.constexpr):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.)
    for seg in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + seg * BT
        if STORE_CKPT:
            slot = chunk_slot(i_n, bos, seg, T, BT, IS_VARLEN)
            tl.store(ckpt + (slot * HV + i_hv) * K * V + o_kv, S, mask=m_kv)
        for t in range(t0, tl.minimum(t0 + BT, eos)):
            b_k, b_d, b_a, b_b, b_c = _token(k, w, a, b, beta, t, i_h, i_hv, o_k, m_k,
                                             H, HV, K, KDA)
            b_v = _vec(v + (t * HV + i_hv) * V, o_v, m_v)
            S = _advance(S, b_k, b_d, b_a, b_b, b_c, b_v, KDA)
            b_q = _vec(q + (t * H + i_h) * K, o_k, m_k)
            b_o = tl.sum(S * b_q[:, None], axis=0) * scale
            tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + o_kv, S, mask=m_kv)


@triton.jit
def _bwd_kernel(q, k, v, w, a, b, beta, ckpt, do, dht, dh0, dv, part, dbeta, scratch,
                cu_seqlens, scale, T, TT, n_heads, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                BT: tl.constexpr, KDA: tl.constexpr, USE_DHT: tl.constexpr,
                STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr):
    NPART: tl.constexpr = 3 if KDA else 5
    # a grid-stride loop over (value block, sequence x head) items, so that the scratch is
    # one [BT, BK, BV] per launched program, however many sequences there are
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    zero = pid.to(tl.int64) * 0                       # int64 item indices
    for item in range(pid, NV * n_heads, tl.num_programs(0)):
        i_v, i_nh = item % NV + zero, item // NV + zero
        i_n, i_hv = i_nh // HV, i_nh % HV
        i_h = i_hv // (HV // H)
        bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        o_kv = o_k[:, None] * V + o_v[None, :]
        p_scr = (scratch + pid.to(tl.int64) * BT * BK * BV
                 + o_k[:, None] * BV + tl.arange(0, BV)[None, :])
        p_part = part + (i_v * NPART).to(tl.int64) * TT * K + o_k
        G = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_DHT:
            G += tl.load(dht + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.)
        nseg = tl.cdiv(eos - bos, BT)
        for i_s in range(0, nseg):
            seg = nseg - 1 - i_s
            t0 = bos + seg * BT
            t1 = tl.minimum(t0 + BT, eos)
            slot = chunk_slot(i_n, bos, seg, T, BT, IS_VARLEN)
            S = tl.load(ckpt + (slot * HV + i_hv) * K * V + o_kv, mask=m_kv, other=0.)
            # recompute the segment: scratch[j] = S before token t0 + j; dq on the way
            for t in range(t0, t1):
                tl.store(p_scr + (t - t0) * BK * BV, S)
                b_k, b_d, b_a, b_b, b_c = _token(k, w, a, b, beta, t, i_h, i_hv, o_k,
                                                 m_k, H, HV, K, KDA)
                b_v = _vec(v + (t * HV + i_hv) * V, o_v, m_v)
                S = _advance(S, b_k, b_d, b_a, b_b, b_c, b_v, KDA)
                b_do = _vec(do + (t * HV + i_hv) * V, o_v, m_v)
                tl.store(p_part + (t * HV + i_hv) * K, scale * tl.sum(S * b_do[None, :], axis=1),
                         mask=m_k)
            tl.debug_barrier()
            for i_t in range(0, t1 - t0):
                t = t1 - 1 - i_t
                row = t * HV + i_hv
                Sp = tl.load(p_scr + (t - t0) * BK * BV)
                b_k, b_d, b_a, b_b, b_c = _token(k, w, a, b, beta, t, i_h, i_hv, o_k,
                                                 m_k, H, HV, K, KDA)
                b_v = _vec(v + row * V, o_v, m_v)
                b_q = _vec(q + (t * H + i_h) * K, o_k, m_k)
                b_do = _vec(do + row * V, o_v, m_v)
                G += scale * b_q[:, None] * b_do[None, :]
                b_dv = tl.sum(G * b_c[:, None], axis=0)
                tl.store(dv + row * V + o_v, b_dv.to(dv.dtype.element_ty), mask=m_v)
                if KDA:
                    Sp = Sp * b_d[:, None]                                  # S'
                    b_u = b_v - tl.sum(Sp * b_k[:, None], axis=0)
                    b_beta = tl.load(beta + row).to(tl.float32)
                    b_x = -b_dv                                 # -beta G^T k
                    b_y = tl.sum(G * b_u[None, :], axis=1)
                    tl.store(dbeta + i_v * TT + row, tl.sum(b_y * b_k, axis=0))
                    tl.store(p_part + (TT + row) * K,
                             b_beta * b_y + tl.sum(Sp * b_x[None, :], axis=1), mask=m_k)
                    G += b_k[:, None] * b_x[None, :]
                    tl.store(p_part + (2 * TT + row) * K, tl.sum(Sp * G, axis=1), mask=m_k)
                    G = G * b_d[:, None]
                else:
                    b_sa = tl.sum(Sp * b_a[:, None], axis=0)
                    b_x = tl.sum(G * b_b[:, None], axis=0)
                    tl.store(p_part + (TT + row) * K, tl.sum(G * b_v[None, :], axis=1), mask=m_k)
                    tl.store(p_part + (2 * TT + row) * K, tl.sum(G * b_sa[None, :], axis=1),
                             mask=m_k)
                    tl.store(p_part + (3 * TT + row) * K, tl.sum(Sp * b_x[None, :], axis=1),
                             mask=m_k)
                    tl.store(p_part + (4 * TT + row) * K, b_d * tl.sum(Sp * G, axis=1), mask=m_k)
                    G = G * b_d[:, None] + b_a[:, None] * b_x[None, :]
            tl.debug_barrier()
        if STORE_DH0:
            tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_kv, G, mask=m_kv)


def _blocks(K: int, V: int):
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), 32 if BK <= 128 else 16)
    return BK, BV, triton.cdiv(V, BV)


def _max_programs(device) -> int:
    """Backward programs launched at most (each owns a scratch of SEGMENT states)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 64


def _layout(q, v, cu_seqlens):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return B, T, H, HV, K, V, N


def dplr_forward(kda, q, k, v, w, a, b, beta, h0, scale, output_final_state, cu_seqlens,
                 keep_checkpoints, o_dtype):
    """q, k [B, T, H, K]; v [B, T, HV, V]; w (log-decay), a, b [B, T, HV, K] fp32 (KDA: a, b
    None, beta [B, T, HV] fp32); h0 None or [N, HV, K, V] fp32; all contiguous.
    Returns (o [B, T, HV, V] in o_dtype, final state [N, HV, K, V] fp32 or None, checkpoints
    [slots, HV, K, V] fp32 or None)."""
    B, T, H, HV, K, V, N = _layout(q, v, cu_seqlens)
    BK, BV, NV = _blocks(K, V)
    dev = q.device
    o = alloc((B, T, HV, V), o_dtype, dev)
    ht = alloc((N, HV, K, V), torch.float32, dev) if output_final_state else None
    ckpt = None
    if keep_checkpoints:
        ckpt = alloc((n_slots(B, T, N, SEGMENT, cu_seqlens is not None), HV, K, V),
                     torch.float32, dev)
    _fwd_kernel[(N * HV, NV)](
        q, k, v, w, a if a is not None else w, b if b is not None else w,
        beta if beta is not None else w, h0 if h0 is not None else w, o,
        ht if ht is not None else o, ckpt if ckpt is not None else o,
        cu_seqlens if cu_seqlens is not None else w, scale, T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, BT=SEGMENT, KDA=kda, USE_H0=h0 is not None,
        STORE_HT=ht is not None, STORE_CKPT=ckpt is not None,
        IS_VARLEN=cu_seqlens is not None, num_warps=4)
    return o, ht, ckpt


def dplr_backward(kda, q, k, v, w, a, b, beta, h0, ckpt, scale, cu_seqlens, do, dht):
    """Returns (parts [NPART, B, T, HV, K] fp32 summed over value blocks: RWKV-7 (dq, dk, db,
    da, dw), KDA (dq, dk, dg) per value head; KDA's dbeta [B, T, HV] fp32 (else None);
    dv [B, T, HV, V] in v's dtype; dh0 [N, HV, K, V] fp32 or None)."""
    B, T, H, HV, K, V, N = _layout(q, v, cu_seqlens)
    BK, BV, NV = _blocks(K, V)
    dev = q.device
    TT = B * T * HV
    part = alloc((NV, 3 if kda else 5, B, T, HV, K), torch.float32, dev)
    dbeta = alloc((NV, B, T, HV), torch.float32, dev) if kda else None
    dv = alloc((B, T, HV, V), v.dtype, dev)
    dh0 = alloc((N, HV, K, V), torch.float32, dev) if h0 is not None else None
    programs = min(N * HV * NV, _max_programs(dev))
    scratch = torch.empty((programs, SEGMENT, BK, BV), dtype=torch.float32, device=dev)
    _bwd_kernel[(programs,)](
        q, k, v, w, a if a is not None else w, b if b is not None else w,
        beta if beta is not None else w, ckpt, do, dht if dht is not None else w,
        dh0 if dh0 is not None else dv, dv, part, dbeta if dbeta is not None else part,
        scratch, cu_seqlens if cu_seqlens is not None else w, scale, T, TT, N * HV,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, BT=SEGMENT, KDA=kda, USE_DHT=dht is not None,
        STORE_DH0=dh0 is not None, IS_VARLEN=cu_seqlens is not None, num_warps=4)
    if NV == 1:
        return part[0], (dbeta[0] if kda else None), dv, dh0
    return part.sum(0), (dbeta.sum(0) if kda else None), dv, dh0
