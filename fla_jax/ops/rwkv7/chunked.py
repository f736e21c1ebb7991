"""Chunk-parallel RWKV-7 in plain jnp (jit-able, differentiable by autodiff, fp64-capable).

The DPLR chunk algorithm is fla_jax.ops.common.dplr_chunked (shared with KDA): per chunk the
low-rank corrections u_t = a_t^T S_{t-1} come from one unit-lower-triangular solve, and only
the [K, V] state passes from chunk to chunk. Every exponent is <= 0 (per-key log-decays
down to -20 per token stay finite).
"""
from __future__ import annotations

from ..common.dplr_chunked import dplr_chunks
from ..common.compute_operands import compute_dtype

CHUNK_SIZE = 32


def rwkv7_chunked(r, k, v, *, w, a, b, scale, initial_state, output_final_state, cu_seqlens,
                  chunk_size: int = CHUNK_SIZE):
    """r, k, w, a, b: [B, T, H, K]; v: [B, T, H, V]; w, a, b fp32 (fp64 with fp64 r);
    initial_state: None or [N, H, K, V]; cu_seqlens: None or [N+1] int (may be traced).
    Returns (o [B, T, H, V] in r's dtype, final_state [N, H, K, V] or None)."""
    cd = compute_dtype(r)
    o, final = dplr_chunks(*(x.astype(cd) for x in (r, w, k, v, a, b)), scale=scale,
                           initial_state=initial_state, output_final_state=output_final_state,
                           cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return o.astype(r.dtype), final
