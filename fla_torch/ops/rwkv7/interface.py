"""Public RWKV-7 ops (FLA's DPLR convention, `fla.ops.rwkv7`).

Recurrence per head (S: [K, V], fp32):
    S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T
    o_t = scale * r_t S_t
w is a per-key log-decay (<= 0); a, b are per-key vectors (in RWKV-7's layer a = -kk,
b = kk * sigmoid(.), kk a unit vector). w, a, b are used in fp32 whatever dtype arrives.
"""
from __future__ import annotations

from fla_contract import OPS

from ..common.prepare import run_op

_BASE = {"reference": "fla_torch.ops.rwkv7.reference:rwkv7_reference",
         "chunked": "fla_torch.ops.rwkv7.chunked:rwkv7_chunked"}
CHUNK_IMPLS = dict(_BASE)
CHUNK_IMPLS["triton"] = "fla_torch.ops.rwkv7.triton_chunk:chunk_rwkv7_triton"
RECURRENT_IMPLS = dict(_BASE)


def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                cu_seqlens=None, impl="auto"):
    """Chunk-parallel RWKV-7 (FLA's signature).

    Args:
        r, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in {bf16, fp16, fp32} (fp64: reference,
            chunked).
        w: [B, T, H, K] per-key log-decay (<= 0); a, b: [B, T, H, K]; any float dtype, used
            in fp32.
        scale: float, default 1.0 (None: K ** -0.5). initial_state: [N, H, K, V] fp32.
        cu_seqlens: [N+1] int, needs B == 1.
        impl: 'auto' | 'reference' | 'chunked' | 'triton' (where registered).
    Returns:
        o: [B, T, H, V] in r's dtype; final_state: [N, H, K, V] fp32, or None unless
        output_final_state.
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
