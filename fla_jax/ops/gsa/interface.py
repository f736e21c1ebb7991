"""Public Gated Slot Attention ops (FLA's gsa): M memory slots per key/value head.

Per key/value head, with slot write weights s_t in R^M and per-slot log-decay g_t in R^M:
    hk_t = hk_{t-1} diag(exp(g_t)) + k_t^T s_t      hk: [K, M], fp32
    ok_t = scale * q_t hk_t                          (per query head)
    p_t  = softmax(ok_t) over the M slots
    hv_t = diag(exp(g_t)) hv_{t-1} + s_t^T v_t      hv: [M, V], fp32
    o_t  = p_t hv_t
g None (FLA's "vanilla ABC"): s holds slot logits; with z_t = logsumexp(s_1..s_t) per slot
and sequence, the write weights are exp(s_t - z_t) and g_t = z_{t-1} - z_t (0 at a sequence's
first token).
"""
from __future__ import annotations

from fla_contract import OPS, state_parts

from ..common.prepare import run_op

_BASE = {"reference": "fla_jax.ops.gsa.reference:gsa_reference",
         "chunked": "fla_jax.ops.gsa.chunked:gsa_chunked"}
CHUNK_IMPLS = dict(_BASE, pallas="fla_jax.ops.gsa.pallas_chunk:chunk_gsa_pallas")
RECURRENT_IMPLS = dict(
    _BASE, pallas="fla_jax.ops.gsa.pallas_recurrent:fused_recurrent_gsa_pallas")


def _run(op, registry, impl, q, k, v, s, g, scale, initial_state, output_final_state,
         cu_seqlens):
    spec = OPS[op]
    return run_op(spec, registry, impl, q=q, k=k, v=v, s=s, g=g, scale=scale,
                  **state_parts(spec, initial_state), output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens)


def chunk_gsa(q, k, v, s, g=None, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, impl="auto"):
    """Chunk-parallel Gated Slot Attention (FLA's signature).

    Args:
        q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]; s: [B, T, H, M] slot write
            weights (slot logits when g is None); HQ % H == 0 (query head h reads key/value
            head h // (HQ // H)); q, k, v, s one dtype in {bf16, fp16, fp32} (fp64:
            reference, chunked). g: None or [B, T, H, M] per-slot log-decay (<= 0), any float
            dtype, used in fp32. scale: float, default K ** -0.5.
            initial_state: None or (hk0 [N, H, K, M], hv0 [N, H, M, V]) fp32 (either part may
            be None: zeros). cu_seqlens: [N+1] int, needs B == 1.
        impl: 'auto' | 'reference' | 'chunked' | 'pallas'.
    Returns:
        o: [B, T, HQ, V] in q's dtype; final_state: (hk [N, H, K, M], hv [N, H, M, V]) fp32,
        or None unless output_final_state.
    """
    return _run("chunk_gsa", CHUNK_IMPLS, impl, q, k, v, s, g, scale, initial_state,
                output_final_state, cu_seqlens)


def fused_recurrent_gsa(q, k, v, s, g=None, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, impl="auto"):
    """Token-by-token Gated Slot Attention (FLA's signature); same arguments and returns as
    `chunk_gsa`."""
    return _run("fused_recurrent_gsa", RECURRENT_IMPLS, impl, q, k, v, s, g, scale,
                initial_state, output_final_state, cu_seqlens)
