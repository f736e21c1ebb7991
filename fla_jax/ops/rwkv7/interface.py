"""Public RWKV-7 ops (FLA's diagonal-plus-low-rank convention).

Recurrence per head, w_t, a_t, b_t in R^K:
    S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T          S: [K, V], fp32
    o_t = scale * r_t S_t                                            scale default 1.0
w, a and b are used in fp32 whatever dtype arrives; r, k, v share one dtype.
"""
from __future__ import annotations

from fla_contract import OPS

from ..common.prepare import run_op

_BASE = {"reference": "fla_jax.ops.rwkv7.reference:rwkv7_reference",
         "chunked": "fla_jax.ops.rwkv7.chunked:rwkv7_chunked"}
CHUNK_IMPLS = dict(_BASE)
CHUNK_IMPLS["pallas"] = "fla_jax.ops.rwkv7.pallas_chunk:chunk_rwkv7_pallas"
RECURRENT_IMPLS = dict(_BASE)


def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                cu_seqlens=None, impl="auto"):
    """Chunk-parallel RWKV-7 (FLA's signature).

    Args:
        r, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in {bf16, fp16, fp32} (fp64:
            reference, chunked). w: [B, T, H, K] per-key log-decay (<= 0); a, b: [B, T, H, K]
            (a layer passes a = -kk, b = kk * sigmoid(.)); w, a, b any float dtype, used in
            fp32. scale: float, default 1.0. initial_state: [N, H, K, V] fp32.
            cu_seqlens: [N+1] int, needs B == 1 (may be traced under jit).
        impl: 'auto' | 'reference' | 'chunked' | 'pallas'.
    Returns:
        o: [B, T, H, V] in r's dtype; final_state: [N, H, K, V] fp32, or None unless
        output_final_state. Gradients: dr, dk, dv in their dtype; dw, da, db, dh0 fp32.
    """
    return run_op(OPS["chunk_rwkv7"], CHUNK_IMPLS, impl, r=r, w=w, k=k, v=v, a=a, b=b,
                  initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None,
                          output_final_state=False, cu_seqlens=None, impl="auto"):
    """Token-by-token RWKV-7 (FLA's signature); same arguments and returns as `chunk_rwkv7`.
    Its kernel suits decoding and short sequences."""
    return run_op(OPS["fused_recurrent_rwkv7"], RECURRENT_IMPLS, impl, r=r, w=w, k=k, v=v,
                  a=a, b=b, initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)
