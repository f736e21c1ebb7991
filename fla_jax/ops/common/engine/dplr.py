"""The DPLR chunk pipeline (Pallas stages + jnp glue), forward and backward: the mirror of
fla_torch/ops/common/engine/dplr.py.

    S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = scale * r_t S_t
(RWKV-7; KDA is a = exp(g) k, b = -beta k, write key beta k.) The chunk form is the one of
common/dplr_chunked.py with chunks of BT = 64:
 1. slot layout: every input to fp32 [S, BT, H, D] (token-major: for fixed length a
    reshape of [B, T, H, D]; D padded to a power of two >= 16), one slot per chunk (the
    engine's varlen slots: no host synchronisation for cu_seqlens), pad rows zero. The
    stages' own intermediates are head-major [S, H, BT, *];
 2. dplr_scores.dplr_scores: the per-key-decay scores A_ab, A_ak, A_rb, A_rk and the decayed
    vectors r_in, a_in, b_out, k_out, tot (Pallas, split-cumsum gates, exact pairs);
 3. dplr_wy.dplr_wy: the WY terms [u | w] = (I - A_ab)^-1 [A_ak v | a_in] (Pallas, 16-row
    block inversion in registers);
 4. dplr_state.dplr_state: U = u + w S_in and the states S_in per chunk (Pallas);
 5. dplr_output.dplr_output: o = scale (r_in S_in + A_rb U + A_rk v) (Pallas), back to the
    token layout in r's dtype.
Stages 2-5 are custom_vjp functions with Pallas backward kernels; autodiff carries the
gradients through the jnp glue (the slot layout, the row shifts). Every fp32 product is
fp32-accurate (inside allow_tf32() the caller's setting applies): tf32x3 on the GPU for fp32
problems, three bf16 products (hi / lo splits, ~2^-16 relative per term; ptr.SPLIT3) for
bf16 / fp16 ones, whose inputs carry 2^-8 / 2^-11 already.
"""
from __future__ import annotations

import jax.numpy as jnp

from .. import pallas_triton as ptr
from ..token_recurrence import token_sequence_ids
from .dplr_output import dplr_output
from .dplr_scores import dplr_scores
from .dplr_state import dplr_state
from .dplr_wy import dplr_wy
from .varlen import n_chunks, n_slots

BT = 64
F32 = jnp.float32
# The in-kernel products of a bf16 problem: ptr.BF16 (operands rounded to bf16, accumulated in
# fp32, as the Triton DPLR stages of a bf16 op) or ptr.SPLIT3 (fp32-accurate, three bf16
# products each). fp16 and fp32 problems keep ptr.problem_precision.
BF16_PRODUCTS = [ptr.BF16]


def precision(dtype):
    """The `prec` of every stage for a problem whose r, k, v have `dtype`."""
    prec = ptr.problem_precision(dtype)
    if jnp.dtype(dtype) == jnp.bfloat16 and prec == ptr.SPLIT3:
        return BF16_PRODUCTS[-1]
    return prec


def slot_rows(B: int, T: int, cu_seqlens):
    """(row [B*T] int32: the slot-layout row of every token, or None for fixed length (slot
    b * NT + c holds row b's tokens c * BT ..: a reshape, see to_slots), first [N], count [N]
    int32, slots S). Traced-safe (no host synchronisation)."""
    NT = n_chunks(T, BT)
    if cu_seqlens is None:
        row = None
        first = jnp.arange(B, dtype=jnp.int32) * NT
        count = jnp.full((B,), NT, jnp.int32)
        return row, first, count, B * NT
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    N = cu.shape[0] - 1
    n, _ = token_sequence_ids(cu, T)
    bos = cu[n]
    row = (bos // BT + n) * BT + (jnp.arange(T, dtype=jnp.int32) - bos)
    first = cu[:-1] // BT + jnp.arange(N, dtype=jnp.int32)
    count = (cu[1:] - cu[:-1] + BT - 1) // BT
    return row, first, count, n_slots(T, BT, N, True)


def to_slots(x, row, S, Dp, dtype=F32):
    """[B, T, H, D] -> [S, BT, H, Dp] in `dtype`, the token-major slot layout (pad rows and
    columns zero; differentiable). row None (fixed length: slot b * NT + c holds tokens c * BT .. of
    row b): a reshape (a pad first where T % BT or Dp - D is not 0), no transpose and no
    scatter (whose gradient would be a gather, and the reverse's a scatter-add)."""
    B, T, H, D = x.shape
    if row is None:
        NT = S // B
        xp = x.astype(dtype)
        if NT * BT != T or Dp != D:
            xp = jnp.pad(xp, ((0, 0), (0, NT * BT - T), (0, 0), (0, Dp - D)))
        return xp.reshape(S, BT, H, Dp)
    flat = x.reshape(B * T, H, D).astype(dtype)
    if Dp != D:
        flat = jnp.pad(flat, ((0, 0), (0, 0), (0, Dp - D)))
    return jnp.zeros((S * BT, H, Dp), dtype).at[row].set(flat).reshape(S, BT, H, Dp)


def from_slots(y, row, B, T, D):
    """[S, BT, H, Dp] -> [B, T, H, D] (differentiable; row None: fixed length, a reshape and
    a slice)."""
    S, _, H, Dp = y.shape
    if row is None:
        return y.reshape(B, (S // B) * BT, H, Dp)[:, :T, :, :D]
    return y.reshape(S * BT, H, Dp)[row][..., :D].reshape(B, T, H, D)


def _shift_up(x):
    """Token-major x [S, BT, H, D]: x[:, m] <- x[:, m + 1] within each chunk (last row
    zero)."""
    return jnp.pad(x[:, 1:], ((0, 0), (0, 1), (0, 0), (0, 0)))


def _shift_down(x):
    """x[:, :, i] <- x[:, :, i - 1] within each chunk (row 0 zero)."""
    return jnp.pad(x[:, :, :-1], ((0, 0), (0, 0), (1, 0), (0, 0)))


def dplr_chunk(r, k, v, w, a, b, scale, initial_state, output_final_state, cu_seqlens):
    """r, k: [B, T, H, K] and v [B, T, H, V] (any float dtype, used in fp32); w, a, b
    [B, T, H, K] fp32; initial_state [N, H, K, V] fp32 or None; cu_seqlens None or int
    [N+1] (B == 1, may be traced). Returns (o [B, T, H, V] fp32, final state
    [N, H, K, V] fp32 or None); differentiable w.r.t. every float input."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    Kp, Vp = ptr.padded(K), ptr.padded(V)
    prec = precision(r.dtype)
    row, first, count, S = slot_rows(B, T, cu_seqlens)
    # r, k, v stay bf16 for a BF16 problem (every stage reads them as fp32 or into BF16
    # products): no conversion pass, and their gradients come back in bf16
    sd = ptr.store_dtype(prec)           # bf16 only for ptr.BF16, i.e. a bf16 problem
    rs, ks = (to_slots(x, row, S, Kp, sd) for x in (r, k))
    ws, as_, bs = (to_slots(x, row, S, Kp) for x in (w, a, b))
    vs = to_slots(v, row, S, Vp, sd)
    M_rb, M_rk, M_ab, M_ak, r_in, as_in, b_out, k_out, tot = dplr_scores(
        rs, ks, _shift_up(as_), bs, ws, prec)
    A_ab, A_ak = _shift_down(M_ab), _shift_down(M_ak)
    a_in = jnp.concatenate([jnp.swapaxes(as_[:, :1], 1, 2).astype(as_in.dtype),
                            as_in[:, :, :-1]], axis=2)
    u, wy = dplr_wy(A_ab, A_ak, vs, a_in, prec)
    h0 = initial_state
    if h0 is not None and (Kp != K or Vp != V):
        h0 = jnp.pad(h0.astype(F32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
    U, S_in, ht = dplr_state(u, wy, b_out, k_out, vs, tot, h0, first, count, prec,
                             row is None)
    o = dplr_output(r_in, S_in, M_rb, U, M_rk, vs, scale, prec)
    o = from_slots(o, row, B, T, V)
    return o, (ht[:, :, :K, :V] if output_final_state else None)
