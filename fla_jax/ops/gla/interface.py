"""Public GLA ops: per-token, per-key-channel log-decay g [B, T, H, K].

Recurrence per head (g_t in R^K, <= 0):
    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t      S: [K, V], fp32
    o_t = scale * q_t S_t
"""
from __future__ import annotations

from fla_contract import OPS

from ..common import context_parallel
from ..common.mosaic.dispatch import mosaic_or
from ..common.prepare import run_op

_BASE = {"reference": "fla_jax.ops.gla.reference:gla_reference",
         "chunked": "fla_jax.ops.gla.chunked:gla_chunked"}
CHUNK_IMPLS = dict(_BASE, pallas="fla_jax.ops.gla.pallas_chunk:chunk_gla_pallas",
                   mosaic="fla_jax.ops.gla.mosaic_chunk:chunk_gla_mosaic")
RECURRENT_IMPLS = dict(_BASE, pallas="fla_jax.ops.gla.pallas_recurrent:fused_recurrent_gla_pallas")


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, impl="auto", cp_mesh_axis=None):
    """Chunk-parallel gated linear attention (FLA's signature).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in {bf16, fp16, fp32} (fp64: reference,
            chunked). g: [B, T, H, K] log-decay (<= 0), any float dtype, used in fp32.
            scale: float, default K ** -0.5. initial_state: [N, H, K, V] fp32.
            cu_seqlens: [N+1] int, needs B == 1.
        impl: 'auto' | 'reference' | 'chunked' | 'pallas' | 'mosaic' (Pallas Mosaic GPU
            forward and backward kernels: Hopper only, bf16/fp16, K and V multiples of 64 up
            to 256; GPU-proven at K = V = 128, where 'auto' takes them on Hopper).
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
            "gla", chunk_gla, cp_mesh_axis, q, k, v, g=g, scale=scale,
            initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, impl=impl)
    impl = mosaic_or("chunk_gla", impl, q, lambda: mosaic_unsupported_reason(
        q, k, v, g, initial_state, cu_seqlens) or _auto_reason(q, v))
    return run_op(OPS["chunk_gla"], CHUNK_IMPLS, impl, q=q, k=k, v=v,
                  g=g, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fused_recurrent_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, impl="auto"):
    """Token-by-token GLA (FLA's signature); same arguments and returns as `chunk_gla`.
    Its kernel suits decoding and short sequences."""
    return run_op(OPS["fused_recurrent_gla"], RECURRENT_IMPLS, impl, q=q, k=k, v=v,
                  g=g, scale=scale,
                  initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens)


def mosaic_unsupported_reason(q, k, v, g=None, initial_state=None, cu_seqlens=None):
    """Why impl='mosaic' cannot take this chunk_gla call (str), or None when it can (dtypes
    and head sizes; the backend is checked when it runs)."""
    from .mosaic_chunk import mosaic_unsupported_reason as reason
    return reason(q, k, v, g, initial_state, cu_seqlens)


def _auto_reason(q, v):
    from .mosaic_chunk import auto_unsupported_reason
    return auto_unsupported_reason(q, v)
