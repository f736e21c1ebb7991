"""Chunk-parallel Gated Slot Attention in plain jnp (jit-able, differentiable).

The slot pass has its decay on the value (slot) side. Per chunk of C tokens with
b = inclusive cumsum of g over the chunk ([C, M]) and hk the state entering the chunk:
    ok    = scale * ((q hk) * exp(b) + sum_{j <= i} (q_i . k_j) s_j * exp(b_i - b_j))
    hk^T_out = diag(exp(b_C)) hk^T + (s * exp(b_C - b))^T k
so the state pass is GLA's on the transposed state [M, K] (keys s, values k). The in-chunk
decays are masked before exp, a token's own decay is the constant 1 and exp(b_C - b_j) comes
from direct suffix sums (no O(1) gradient terms formed and cancelled; strong gates).
The value pass (q = softmax(ok), k = s, v, key-side gate g, scale 1) is chunked GLA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common.chunk_decay import causal_mask, chunk_cumsum, chunk_suffix
from ..common.chunk_packing import (chunk_initial_states, from_chunks, gather_final_states,
                                    plan_chunks, to_chunks)
from ..common.chunk_state_scan import scan_chunk_states
from ..common.compute_operands import einsum
from ..gla.chunked import gla_chunked
from .slot_inputs import group_final, gsa_operands

CHUNK_SIZE = 16


def slot_pass_chunked(q, k, s, g, scale, hk0, output_final_state, cu_seqlens,
                      chunk_size=CHUNK_SIZE):
    """q, k: [B, T, H, K]; s, g: [B, T, H, M] (one compute dtype); hk0: None or [N, H, K, M].
    Returns (ok [B, T, H, M], hk [N, H, K, M] or None)."""
    cd = q.dtype
    B, T, H, K = k.shape
    M = s.shape[-1]
    plan = plan_chunks(B, T, cu_seqlens, chunk_size)
    qn, kn, sn, gn = (to_chunks(plan, x) for x in (q, k, s, g))          # [B,NC,H,C,*]
    b = chunk_cumsum(gn)                                                  # [B,NC,H,C,M]
    C = chunk_size
    strict = causal_mask(C, inclusive=False)[..., None]                   # [C, C, 1]
    # the [C, C, M] decays with the leading axes folded into one (at most 4 axes: XLA:CPU's
    # YNNPACK fusions of jaxlib 0.10.2 segfault on some high-rank ones, see gla/chunked.py)
    lead = b.shape[:3]
    bf = b.reshape(-1, C, M)
    gap = bf[:, :, None, :] - bf[:, None, :, :]                           # [L, C, C, M]
    decay = jnp.where(strict, jnp.exp(jnp.where(strict, gap, 0.0)), 0.0)
    decay = decay + jnp.eye(C, dtype=cd)[..., None]
    A = einsum("bnhik,bnhjk->bnhij", qn, kn).reshape(-1, C, C)
    o_intra = jnp.einsum("lij,lijm,ljm->lim", A, decay, sn.reshape(-1, C, M),
                         preferred_element_type=cd).reshape(*lead, C, M)

    shape = (H, M, K)
    h0t = None if hk0 is None else jnp.swapaxes(hk0, -1, -2)
    carry0, reset_states = chunk_initial_states(plan, h0t, shape, cd)
    S_in, S_after, S_last = scan_chunk_states(
        jnp.exp(b[..., -1, :]), sn * jnp.exp(chunk_suffix(gn)), kn, None, carry0,
        reset=plan.reset, reset_states=reset_states,
        collect_after=output_final_state and plan.varlen)                # S_in [B,NC,H,M,K]
    o_inter = einsum("bnhck,bnhmk->bnhcm", qn, S_in) * jnp.exp(b)
    ok = from_chunks(plan, scale * (o_inter + o_intra))
    if not output_final_state:
        return ok, None
    final = gather_final_states(plan, S_after, S_last, h0t, shape, cd)
    return ok, jnp.swapaxes(final, -1, -2)


def gsa_chunked(q, k, v, s, *, g=None, scale, initial_state=None, output_final_state=False,
                cu_seqlens=None):
    """Same arguments and returns as gsa.reference.gsa_reference."""
    qf, kf, vf, sf, gf, hk0, hv0, NG = gsa_operands(q, k, v, s, g, initial_state, cu_seqlens)
    ok, hk = slot_pass_chunked(qf, kf, sf, gf, scale, hk0, output_final_state, cu_seqlens)
    o, hv = gla_chunked(jax.nn.softmax(ok, axis=-1), sf, vf, g=gf, scale=1.0,
                        initial_state=hv0, output_final_state=output_final_state,
                        cu_seqlens=cu_seqlens)
    final = (group_final(hk, NG), group_final(hv, NG)) if output_final_state else None
    return o.astype(q.dtype), final
