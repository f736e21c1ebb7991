"""Public Kimi Delta Attention ops: the gated delta rule with a per-key-channel log-decay.

Recurrence per value head hv (q/k head hv // (HV // H)), g_t in R^K:
    S'_{t-1} = diag(exp(g_t)) S_{t-1}
    S_t = S'_{t-1} + beta_t k_t (v_t - k_t^T S'_{t-1})              S: [K, V], fp32
    o_t = scale * q_t S_t
With use_qk_l2norm_in_kernel, q and k are first normalised over K in fp32:
x / sqrt(sum(x^2) + 1e-6).
"""
from __future__ import annotations

from fla_contract import OPS

from ..common.fla_inputs import apply_transforms
from ..common.prepare import run_op

_BASE = {"reference": "fla_jax.ops.kda.reference:kda_reference",
         "chunked": "fla_jax.ops.kda.chunked:kda_chunked"}
CHUNK_IMPLS = dict(_BASE)
CHUNK_IMPLS["pallas"] = "fla_jax.ops.kda.pallas_chunk:chunk_kda_pallas"
RECURRENT_IMPLS = dict(_BASE)
RECURRENT_IMPLS["pallas"] = "fla_jax.ops.kda.pallas_recurrent:fused_recurrent_kda_pallas"


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm_in_kernel=False, impl="auto",
              *, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Chunk-parallel Kimi Delta Attention (FLA's signature).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] with HV % H == 0; one dtype in {bf16, fp16,
            fp32} (fp64: reference, chunked). g: [B, T, HV, K] per-key log-decay (<= 0) and
            beta: [B, T, HV], any float dtype, used in fp32. scale: float, default K ** -0.5.
            initial_state: [N, HV, K, V] fp32. cu_seqlens: [N+1] int, needs B == 1 (may be
            traced under jit). use_qk_l2norm_in_kernel: L2-normalise q and k over K inside
            the op (fp32, differentiable).
        impl: 'auto' | 'reference' | 'chunked' | 'pallas'.
        FLA's input transforms (keyword-only; fla_contract/fla_inputs.py): with
            use_gate_in_kernel, g is the raw gate projection and the gate is
            -exp(A_log) softplus(g + dt_bias) (A_log [HV], dt_bias [HV * K]), or
            lower_bound * sigmoid(exp(A_log) (g + dt_bias)) with lower_bound < 0; with
            use_beta_sigmoid_in_kernel, beta holds logits: sigmoid(beta), doubled by
            allow_neg_eigval. Applied in fp32 before the op (not fused into the kernels).
    Returns:
        o: [B, T, HV, V] in q's dtype; final_state: [N, HV, K, V] fp32, or None unless
        output_final_state. Gradients: dq, dk, dv in their dtype; dg, dbeta, dh0 fp32.
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
