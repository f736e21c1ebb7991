"""Public simple-GLA ops: scalar per-token decay g [B, T, H], fixed decay g_gamma [H], or none.

Recurrence per head (g_t = g[t] + g_gamma, either may be absent):
    S_t = exp(g_t) * S_{t-1} + k_t^T v_t          S: [K, V], fp32
    o_t = scale * q_t S_t
Covers linear attention (no gate), RetNet (g_gamma) and simple GLA / Lightning attention (g).
"""
from __future__ import annotations

from fla_contract import OPS

from ..common import context_parallel
from ..common.mosaic.dispatch import mosaic_or
from ..common.prepare import run_op

_BASE = {"reference": "fla_jax.ops.simple_gla.reference:simple_gla_reference",
         "chunked": "fla_jax.ops.simple_gla.chunked:simple_gla_chunked"}
CHUNK_IMPLS = dict(_BASE, pallas="fla_jax.ops.simple_gla.pallas_chunk:chunk_simple_gla_pallas",
                   mosaic="fla_jax.ops.simple_gla.mosaic_chunk:chunk_simple_gla_mosaic")
RECURRENT_IMPLS = dict(
    _BASE, pallas="fla_jax.ops.simple_gla.pallas_recurrent:fused_recurrent_simple_gla_pallas")


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None, impl="auto", cp_mesh_axis=None):
    """Chunk-parallel simple GLA (FLA's signature).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in {bf16, fp16, fp32} (fp64: reference,
            chunked). g: [B, T, H] log-decay (<= 0), any float dtype, used in fp32.
            g_gamma: [H] fixed log-decay. scale: float, default K ** -0.5.
            initial_state: [N, H, K, V] fp32. cu_seqlens: [N+1] int, needs B == 1.
        impl: 'auto' | 'reference' | 'chunked' | 'pallas' | 'mosaic' (Pallas Mosaic GPU
            kernels: Hopper only, bf16/fp16, K and V multiples of 64 up to 256; 'auto' takes
            them on a Hopper GPU once proven there, see mosaic_unsupported_reason).
        cp_mesh_axis: context parallelism (the sequence split along T): the name of a mesh
            axis of the enclosing shard_map;
            see fla_jax/ops/common/context_parallel.py (cu_seqlens, initial_state and
            final_state are then global).
    Returns:
        o: [B, T, H, V] in q's dtype; final_state: [N, H, K, V] fp32, or None unless
        output_final_state.
    """
    if cp_mesh_axis is not None:
        return context_parallel.chunk_context_parallel(
            "simple_gla", chunk_simple_gla, cp_mesh_axis, q, k, v, g=g, g_gamma=g_gamma,
            scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, impl=impl)
    impl = mosaic_or("chunk_simple_gla", impl, q, lambda: mosaic_unsupported_reason(
        q, k, v, g, g_gamma, initial_state, cu_seqlens))
    return run_op(OPS["chunk_simple_gla"], CHUNK_IMPLS, impl, q=q, k=k, v=v, g=g,
                  g_gamma=g_gamma, initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None, impl="auto"):
    """Token-by-token simple GLA (FLA's signature); same arguments and returns as
    `chunk_simple_gla`. Its kernel suits decoding and short sequences."""
    return run_op(OPS["fused_recurrent_simple_gla"], RECURRENT_IMPLS, impl, q=q, k=k, v=v, g=g,
                  g_gamma=g_gamma, initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def mosaic_unsupported_reason(q, k, v, g=None, g_gamma=None, initial_state=None,
                              cu_seqlens=None):
    """Why impl='mosaic' cannot take this chunk_simple_gla call (str), or None when it can
    (not counting the Hopper GPU it needs). impl='auto' falls back to the Pallas kernels."""
    from .mosaic_chunk import mosaic_unsupported_reason as reason
    return reason(q, k, v, g, g_gamma, initial_state, cu_seqlens)
