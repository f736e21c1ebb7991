"""Public Kimi Delta Attention ops (FLA's `fla.ops.kda`), with grouped value heads.

Recurrence per value head hv, reading q/k head hv // (HV // H) (S: [K, V], fp32):
    S'_{t-1} = diag(exp(g_t)) S_{t-1}
    S_t      = S'_{t-1} + beta_t k_t (v_t - k_t^T S'_{t-1})
    o_t      = scale * q_t S_t
g is a per-key-channel log-decay (<= 0). With use_qk_l2norm_in_kernel, q and k are
l2-normalised over K (in fp32) first.
"""
from __future__ import annotations

from fla_contract import OPS

from ..common.prepare import run_op

_BASE = {"reference": "fla_torch.ops.kda.reference:kda_reference",
         "chunked": "fla_torch.ops.kda.chunked:kda_chunked"}
CHUNK_IMPLS = dict(_BASE)
CHUNK_IMPLS["triton"] = "fla_torch.ops.kda.triton_chunk:chunk_kda_triton"
RECURRENT_IMPLS = dict(_BASE)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm_in_kernel=False, impl="auto"):
    """Chunk-parallel Kimi Delta Attention (FLA's signature).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] with HV % H == 0; one dtype in {bf16, fp16, fp32}
            (fp64: reference, chunked).
        g: [B, T, HV, K] per-key log-decay (<= 0); beta: [B, T, HV]; any float dtype, used in
            fp32.
        scale: float, default K ** -0.5. initial_state: [N, HV, K, V] fp32.
        cu_seqlens: [N+1] int, needs B == 1. use_qk_l2norm_in_kernel: bool.
        impl: 'auto' | 'reference' | 'chunked' | 'triton' (where registered).
    Returns:
        o: [B, T, HV, V] in q's dtype; final_state: [N, HV, K, V] fp32, or None unless
        output_final_state.
    """
    return run_op(OPS["chunk_kda"], CHUNK_IMPLS, impl, q=q, k=k, v=v, g=g, beta=beta,
                  initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None,
                        use_qk_l2norm_in_kernel=False, impl="auto"):
    """Token-by-token Kimi Delta Attention (FLA's signature); same arguments and returns as
    `chunk_kda`. Its kernel suits decoding and short sequences."""
    return run_op(OPS["fused_recurrent_kda"], RECURRENT_IMPLS, impl, q=q, k=k, v=v, g=g,
                  beta=beta, initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
