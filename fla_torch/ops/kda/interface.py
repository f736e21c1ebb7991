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

from ..common.fla_inputs import apply_transforms
from ..common.prepare import run_op

_BASE = {"reference": "fla_torch.ops.kda.reference:kda_reference",
         "chunked": "fla_torch.ops.kda.chunked:kda_chunked"}
CHUNK_IMPLS = dict(_BASE)
CHUNK_IMPLS["triton"] = "fla_torch.ops.kda.triton_chunk:chunk_kda_triton"
RECURRENT_IMPLS = dict(_BASE)
RECURRENT_IMPLS["triton"] = "fla_torch.ops.kda.triton_recurrent:fused_recurrent_kda_triton"


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm_in_kernel=False, impl="auto",
              *, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Chunk-parallel Kimi Delta Attention (FLA's signature).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] with HV % H == 0; one dtype in {bf16, fp16, fp32}
            (fp64: reference, chunked).
        g: [B, T, HV, K] per-key log-decay (<= 0); beta: [B, T, HV]; any float dtype, used in
            fp32.
        scale: float, default K ** -0.5. initial_state: [N, HV, K, V] fp32.
        cu_seqlens: [N+1] int, needs B == 1. use_qk_l2norm_in_kernel: bool.
        impl: 'auto' | 'reference' | 'chunked' | 'triton' (where registered).
        FLA's input transforms (keyword-only; fla_contract/fla_inputs.py): with
            use_gate_in_kernel, g is the raw gate projection and the gate is
            -exp(A_log) softplus(g + dt_bias) (A_log [HV], dt_bias [HV * K]), or
            lower_bound * sigmoid(exp(A_log) (g + dt_bias)) with lower_bound < 0; with
            use_beta_sigmoid_in_kernel, beta holds logits: sigmoid(beta), doubled by
            allow_neg_eigval. Applied in fp32 before the op (not fused into the kernels).
    Returns:
        o: [B, T, HV, V] in q's dtype; final_state: [N, HV, K, V] fp32, or None unless
        output_final_state.
    """
    g, beta = apply_transforms("chunk_kda", g, beta, use_gate_in_kernel=use_gate_in_kernel,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval)
    return run_op(OPS["chunk_kda"], CHUNK_IMPLS, impl, q=q, k=k, v=v, g=g, beta=beta,
                  initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None,
                        use_qk_l2norm_in_kernel=False, impl="auto",
                        *, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Token-by-token Kimi Delta Attention (FLA's signature); same arguments and returns as
    `chunk_kda`. Its kernel suits decoding and short sequences."""
    g, beta = apply_transforms("fused_recurrent_kda", g, beta,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval)
    return run_op(OPS["fused_recurrent_kda"], RECURRENT_IMPLS, impl, q=q, k=k, v=v, g=g,
                  beta=beta, initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
