"""Chunk-parallel RWKV-7 in plain torch ops (autograd; the CPU path): the DPLR chunk form of
common/dplr_chunked.py with RWKV-7's own r, w, k, v, a, b."""
from __future__ import annotations

from ..common.dplr_chunked import dplr_chunked
from ..common.qk_inputs import prepare_qkv


def rwkv7_chunked(r, k, v, w, a, b, scale=1.0, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    """r, k, w, a, b: [B, T, H, K]; v: [B, T, H, V].

    Returns (o [B, T, H, V] in r's dtype, final_state [N, H, K, V] fp32 (fp64 for fp64 r)).
    """
    rf, kf, vf = prepare_qkv(r, k, v)
    cd = rf.dtype
    o, final = dplr_chunked(rf, kf, vf, w.to(cd), a.to(cd), b.to(cd), scale, initial_state,
                            output_final_state, cu_seqlens)
    return o.to(r.dtype), final
