"""chunk_rwkv7 on the Pallas DPLR chunk pipeline (common/engine/dplr.py), forward and
backward; runs interpreted off-GPU."""
from __future__ import annotations

from ..common.engine.dplr import dplr_chunk


def chunk_rwkv7_pallas(r, k, v, *, w, a, b, scale, initial_state, output_final_state,
                       cu_seqlens):
    """r, k: [B, T, H, K]; v: [B, T, H, V], one dtype in bf16/fp16/fp32 (K, V <= 256); w, a,
    b: [B, T, H, K] fp32; initial_state: None or [N, H, K, V] fp32; cu_seqlens: None or
    [N+1] int (B == 1, may be traced). Returns (o [B, T, H, V] in r's dtype, final_state
    [N, H, K, V] fp32 or None). Differentiable w.r.t. r, k, v, w, a, b, initial_state."""
    o, ht = dplr_chunk(r, k, v, w, a, b, float(scale), initial_state, output_final_state,
                       cu_seqlens)
    return o.astype(r.dtype), ht
