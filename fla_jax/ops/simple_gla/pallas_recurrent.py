"""Token-by-token simple GLA as Pallas kernels (Triton lowering), forward and backward.

Per sequence and head, with a_t = g_t + gamma (either may be absent):
    S_t = exp(a_t) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t        S: [K, V] fp32
The state lives in registers, one token per step, all arithmetic elementwise in fp32 (no
matmuls, so no precision setting applies). Suits decoding and short sequences; for long
sequences the chunked kernels (pallas_chunk.py) are faster. Kernels (program = one sequence,
one head, one block of K or V), the same split as the chunked backward:
    forward  (n, h, V-block) tokens forward:  o_t, final state
    dq       (n, h, K-block) tokens forward:  dq_t = scale S_t do_t, q_t . dq_t
    dv       (n, h, V-block) tokens backward: dS += scale q_t^T do_t; dv_t = dS^T k_t;
                                               dS *= exp(a_t)
    dk       (n, h, K-block) tokens backward: same dS; dk_t = dS v_t, dh0,
                                               dg_t = sum_{s >= t} (q_s.dq_s - k_s.dk_s)
                                                      + <dS_T, S_T>
BlockSpecs, varlen handling and the custom_vjp wiring are shared with pallas_chunk.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..common import pallas_triton as ptr
from . import pallas_chunk as pc

TUNING = {"bt": 1, "state_elems": 4096, "fwd_bv": None, "bwd_bk": None, "bwd_bv": None,
          "fwd_warps": 4, "fwd_stages": 1, "bwd_warps": 4, "bwd_stages": 1}


def _decay(refs, st, gamma, t):
    """exp(g_t + gamma) as an fp32 scalar, or None without any decay."""
    a = None
    if st.has_g:
        a = refs["g"][t].astype(jnp.float32)
    if gamma is not None:
        a = gamma if a is None else a + gamma
    return None if a is None else jnp.exp(a)


def _fwd_kernel(refs, st):
    BV = st.fwd_bv
    c0 = pl.program_id(2) * BV
    bos, L = pc._bounds(refs, st)
    gamma = pc._gamma(refs, st)
    S0 = (ptr.load_tile(refs["h0"], st.K, st.V, 0, c0) if st.has_h0
          else jnp.zeros((st.Kp, BV), jnp.float32))

    def body(i, S):
        t = bos + i
        q = ptr.load_row(refs["q"], t, st.K).astype(jnp.float32)
        k = ptr.load_row(refs["k"], t, st.K).astype(jnp.float32)
        v = ptr.load_row(refs["v"], t, st.V, c0).astype(jnp.float32)
        a = _decay(refs, st, gamma, t)
        S = (S if a is None else S * a) + k[:, None] * v[None, :]
        ptr.store_row(refs["o"], t, st.scale * jnp.sum(q[:, None] * S, 0), st.V, c0)
        return S

    S = lax.fori_loop(0, L, body, S0)
    ptr.store_tile(refs["ht"], S, st.K, st.V, 0, c0)


def _dq_kernel(refs, st):
    BK = st.bwd_bk
    r0 = pl.program_id(2) * BK
    bos, L = pc._bounds(refs, st)
    gamma = pc._gamma(refs, st)
    S0 = (ptr.load_tile(refs["h0"], st.K, st.V, r0, 0) if st.has_h0
          else jnp.zeros((BK, st.Vp), jnp.float32))

    def body(i, S):
        t = bos + i
        k = ptr.load_row(refs["k"], t, st.K, r0).astype(jnp.float32)
        v = ptr.load_row(refs["v"], t, st.V).astype(jnp.float32)
        do = ptr.load_row(refs["do"], t, st.V).astype(jnp.float32)
        a = _decay(refs, st, gamma, t)
        S = (S if a is None else S * a) + k[:, None] * v[None, :]
        dq = st.scale * jnp.sum(S * do[None, :], 1)
        ptr.store_row(refs["dq"], t, dq, st.K, r0)
        if st.has_g:
            q = ptr.load_row(refs["q"], t, st.K, r0).astype(jnp.float32)
            refs["qdq"][t] = jnp.sum(q * dq)
        return S

    lax.fori_loop(0, L, body, S0)


def _dv_kernel(refs, st):
    BV = st.bwd_bv
    c0 = pl.program_id(2) * BV
    bos, L = pc._bounds(refs, st)
    gamma = pc._gamma(refs, st)
    dS0 = ptr.load_tile(refs["dht"], st.K, st.V, 0, c0)

    def body(i, dS):
        t = bos + L - 1 - i
        q = ptr.load_row(refs["q"], t, st.K).astype(jnp.float32)
        k = ptr.load_row(refs["k"], t, st.K).astype(jnp.float32)
        do = ptr.load_row(refs["do"], t, st.V, c0).astype(jnp.float32)
        dS = dS + st.scale * q[:, None] * do[None, :]
        ptr.store_row(refs["dv"], t, jnp.sum(dS * k[:, None], 0), st.V, c0)
        a = _decay(refs, st, gamma, t)
        return dS if a is None else dS * a

    lax.fori_loop(0, L, body, dS0)


def _dk_kernel(refs, st):
    BK = st.bwd_bk
    kb = pl.program_id(2)
    r0 = kb * BK
    bos, L = pc._bounds(refs, st)
    gamma = pc._gamma(refs, st)
    dS0 = ptr.load_tile(refs["dht"], st.K, st.V, r0, 0)
    if st.has_g:
        n, h = pl.program_id(0), pl.program_id(1)
        carry0 = jnp.where(kb == 0, refs["cterm"][n, h], 0.0).astype(jnp.float32)
    else:
        carry0 = jnp.zeros((), jnp.float32)

    def body(i, state):
        dS, carry = state
        t = bos + L - 1 - i
        q = ptr.load_row(refs["q"], t, st.K, r0).astype(jnp.float32)
        k = ptr.load_row(refs["k"], t, st.K, r0).astype(jnp.float32)
        v = ptr.load_row(refs["v"], t, st.V).astype(jnp.float32)
        do = ptr.load_row(refs["do"], t, st.V).astype(jnp.float32)
        dS = dS + st.scale * q[:, None] * do[None, :]
        dk = jnp.sum(dS * v[None, :], 1)
        ptr.store_row(refs["dk"], t, dk, st.K, r0)
        if st.has_g:
            carry = carry + refs["qdq"][t] - jnp.sum(k * dk)
            refs["dg"][t] = carry
        a = _decay(refs, st, gamma, t)
        return (dS if a is None else dS * a), carry

    dS, _ = lax.fori_loop(0, L, body, (dS0, carry0))
    if st.has_h0:
        ptr.store_tile(refs["dh0"], dS, st.K, st.V, r0, 0)


_KERNELS = pc.Kernels(fwd=_fwd_kernel, dq=_dq_kernel, dv=_dv_kernel, dk=_dk_kernel,
                      name="simple_gla_recurrent")


def fused_recurrent_simple_gla_pallas(q, k, v, *, g=None, g_gamma=None, scale,
                                      initial_state=None, output_final_state=False,
                                      cu_seqlens=None):
    """Pallas (Triton lowering) token-by-token simple GLA; runs interpreted off-GPU.

    Args and returns as `pallas_chunk.chunk_simple_gla_pallas`: q, k [B, T, H, K], v
    [B, T, H, V] (bf16/fp16/fp32), g None or fp32 [B, T, H], g_gamma None or fp32 [H],
    initial_state None or fp32 [N, H, K, V], cu_seqlens None or int [N+1] (B == 1).
    Returns o [B, T, H, V] in q's dtype and the fp32 final state [N, H, K, V] (or None).
    """
    st = pc._make_static(q, v, g, g_gamma, initial_state, cu_seqlens, scale, TUNING)
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    o, ht = pc.simple_gla_vjp(_KERNELS, st, q, k, v, g, g_gamma, initial_state, cu)
    return o, (ht if output_final_state else None)
