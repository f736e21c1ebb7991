"""Public GLA ops: a per-channel log-decay g [B, T, H, K].

Recurrence per head (S: [K, V], fp32):
    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t
    o_t = scale * q_t S_t
"""
from __future__ import annotations

from fla_contract import OPS

from ..common import context_parallel
from ..common.prepare import run_op

_BASE = {"reference": "fla_torch.ops.gla.reference:gla_reference",
         "chunked": "fla_torch.ops.gla.chunked:gla_chunked"}
CHUNK_IMPLS = dict(_BASE, triton="fla_torch.ops.gla.triton_chunk:chunk_gla_triton")
RECURRENT_IMPLS = dict(_BASE,
                       triton="fla_torch.ops.gla.triton_recurrent:fused_recurrent_gla_triton")


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, impl="auto", cp_group=None):
    """Chunk-parallel GLA (FLA's signature).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in {bf16, fp16, fp32} (fp64: reference,
            chunked). g: [B, T, H, K] log-decay (<= 0), any float dtype, used in fp32.
            scale: float, default K ** -0.5. initial_state: [N, H, K, V] fp32.
            cu_seqlens: [N+1] int, needs B == 1.
        impl: 'auto' | 'reference' | 'chunked' | 'triton'.
        cp_group: context parallelism (the sequence split along T): a torch.distributed
            ProcessGroup;
            see fla_torch/ops/common/context_parallel.py (cu_seqlens, initial_state and
            final_state are then global).
    Returns:
        o: [B, T, H, V] in q's dtype; final_state: [N, H, K, V] fp32, or None unless
        output_final_state.
    """
    if cp_group is not None:
        return context_parallel.chunk_context_parallel(
            "gla", chunk_gla, cp_group, q, k, v, g=g, scale=scale,
            initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, impl=impl)
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
