"""Chunk-parallel GLA (per-key-channel log-decay) in plain jnp (jit-able, differentiable).

Per chunk of C tokens with b = inclusive cumsum of g over the chunk ([C, K]) and S the state
entering the chunk:
    o     = scale * ((q * exp(b)) S + A v),   A[i, j] = sum_k q_ik k_jk exp(b_ik - b_jk), j <= i
    S_out = diag(exp(b_C)) S + (k * exp(b_C - b))^T v
A is built from sub-blocks of c = 8 tokens so every exponent stays <= 0 (strong gates):
  - diagonal sub-blocks use the full masked [c, c, K] tensor of exp(b_i - b_j), masked
    before exp;
  - for i in a later sub-block than j's sub-block J, with r_J = b at J's last token,
    exp(b_i - b_j) = exp(b_i - r_J) * exp(r_J - b_j), both factors <= 1.
The state passes from chunk to chunk in fla_jax.ops.common.chunk_state_scan.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.chunk_decay import causal_mask, chunk_cumsum, chunk_suffix
from ..common.chunk_packing import (chunk_initial_states, from_chunks, gather_final_states,
                                    plan_chunks, to_chunks)
from ..common.chunk_state_scan import scan_chunk_states
from ..common.compute_operands import einsum, prepare_qkv

CHUNK_SIZE = 64
SUB_CHUNK = 8


def _masked_exp(diff, mask):
    """exp(diff) where mask else 0, masking before exp (no overflow, no NaN gradients)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def intra_chunk_scores(qn, kn, gn, b, sub: int):
    """qn, kn, gn (log-decays), b (their in-chunk cumsum): [B, NC, H, C, K] -> A [B, NC, H, C, C]
    (zero above the diagonal). Zero-length gaps are constants and gaps to a sub-block's end
    are direct suffix sums (see common/chunk_decay.py: no cancelled O(1) gradient terms).

    The leading axes are folded into one, so no tensor here has more than 5 axes: XLA:CPU's
    YNNPACK fusions (jaxlib 0.10.2) segfault at run time on some 7-axis element-wise / reduce
    fusions of this function's gradient (the varlen GLA and GSA parity cases)."""
    *lead, C, K = qn.shape
    L = 1
    for n in lead:
        L *= n
    A = _scores(*(x.reshape(L, C, K) for x in (qn, kn, gn, b)), sub)
    return A.reshape(*lead, C, C)


def _scores(qn, kn, gn, b, sub: int):
    """intra_chunk_scores on [L, C, K] operands -> [L, C, C]."""
    *lead, C, K = qn.shape
    nb = C // sub
    qs, ks, bs = (x.reshape(*lead, nb, sub, K) for x in (qn, kn, b))

    strict = causal_mask(sub, inclusive=False)[..., None]                 # [c, c, 1]
    decay = _masked_exp(bs[..., :, None, :] - bs[..., None, :, :], strict)
    decay = decay + jnp.eye(sub, dtype=decay.dtype)[..., None]           # a token to itself: 1
    diag = jnp.sum(qs[..., :, None, :] * ks[..., None, :, :] * decay, axis=-1)  # [.., nb, c, c]

    ref = bs[..., -1, :]                                                  # [.., nb, K]
    block = jnp.arange(C) // sub
    earlier = (jnp.arange(nb)[None, :] < block[:, None])[..., None]      # [C, nb, 1]
    q_off = qn[..., :, None, :] * _masked_exp(b[..., :, None, :] - ref[..., None, :, :], earlier)
    gs = gn.reshape(*lead, nb, sub, K)
    k_off = ks * jnp.exp(chunk_suffix(gs, axis=-2))                       # exp(ref - b_j)
    off = einsum("liJk,lJjk->liJj", q_off, k_off)                           # [L, C, nb, c]
    off = off.reshape(*lead, nb, sub, nb, sub)
    eye = jnp.eye(nb, dtype=qn.dtype)[:, None, :, None]
    return (off + diag[..., :, :, None, :] * eye).reshape(*lead, C, C)


def gla_chunked(q, k, v, *, g, scale, initial_state, output_final_state, cu_seqlens,
                chunk_size: int = CHUNK_SIZE):
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] fp32/fp64;
    initial_state: None or [N, H, K, V]; cu_seqlens: None or [N+1] int (may be traced).
    Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)."""
    qc, kc, vc = prepare_qkv(q, k, v)
    cd = qc.dtype
    B, T, HV, K = qc.shape
    V = vc.shape[-1]
    sub = min(SUB_CHUNK, chunk_size)
    if chunk_size % sub:
        raise ValueError(f"gla_chunked: chunk_size={chunk_size}; expected a multiple of {sub}")
    plan = plan_chunks(B, T, cu_seqlens, chunk_size)
    qn, kn, vn = to_chunks(plan, qc), to_chunks(plan, kc), to_chunks(plan, vc)
    gn = to_chunks(plan, g.astype(cd))
    b = chunk_cumsum(gn)                                                  # [B, NC, H, C, K]
    b_last = b[..., -1, :]                                                # [B, NC, H, K]

    o_intra = einsum("bnhij,bnhjv->bnhiv", intra_chunk_scores(qn, kn, gn, b, sub), vn)
    k_decayed = kn * jnp.exp(chunk_suffix(gn))                            # exp(b_last - b)
    carry0, reset_states = chunk_initial_states(plan, initial_state, (HV, K, V), cd)
    S_in, S_after, S_last = scan_chunk_states(
        jnp.exp(b_last), k_decayed, vn, None, carry0,
        reset=plan.reset, reset_states=reset_states,
        collect_after=output_final_state and plan.varlen)
    o_inter = einsum("bnhck,bnhkv->bnhcv", qn * jnp.exp(b), S_in)
    o = from_chunks(plan, scale * (o_inter + o_intra)).astype(q.dtype)
    if not output_final_state:
        return o, None
    return o, gather_final_states(plan, S_after, S_last, initial_state, (HV, K, V), cd)
