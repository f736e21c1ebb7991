"""Public gated delta-rule ops (Gated DeltaNet), with grouped value heads (HV % H == 0).

Recurrence per value head hv, reading q/k head hv // (HV // H) (S: [K, V], fp32):
    S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t
    o_t = scale * q_t S_t
With use_qk_l2norm_in_kernel, q and k are l2-normalised over K (in fp32) first.
"""
from __future__ import annotations

from fla_contract import OPS

from ..common import context_parallel
from ..common.fla_inputs import apply_transforms
from ..common.prepare import run_op

_BASE = {"reference": "fla_torch.ops.gated_delta_rule.reference:gated_delta_rule_reference",
         "chunked": "fla_torch.ops.gated_delta_rule.chunked:gated_delta_rule_chunked"}
CHUNK_IMPLS = dict(_BASE)
CHUNK_IMPLS["triton"] = "fla_torch.ops.gated_delta_rule.triton_chunk:chunk_gated_delta_rule_triton"
RECURRENT_IMPLS = dict(_BASE)
RECURRENT_IMPLS["triton"] = "fla_torch.ops.gated_delta_rule.triton_recurrent:fused_recurrent_gated_delta_rule_triton"


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None,
                           use_qk_l2norm_in_kernel=False, impl="auto", cp_group=None,
                           *, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Chunk-parallel gated delta rule (FLA's signature).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] with HV % H == 0; one dtype in {bf16, fp16, fp32}
            (fp64: reference, chunked). g: [B, T, HV] log-decay (<= 0) and beta: [B, T, HV],
            any float dtype, used in fp32. scale: float, default K ** -0.5.
            initial_state: [N, HV, K, V] fp32. cu_seqlens: [N+1] int, needs B == 1.
            use_qk_l2norm_in_kernel: bool.
        impl: 'auto' | 'reference' | 'chunked' | 'triton'.
        cp_group: context parallelism (the sequence split along T): a torch.distributed
            ProcessGroup;
            see fla_torch/ops/common/context_parallel.py (cu_seqlens, initial_state and
            final_state are then global).
        use_beta_sigmoid_in_kernel, allow_neg_eigval: FLA's input transform (keyword-only;
            fla_contract/fla_inputs.py): beta holds logits, the op uses sigmoid(beta), doubled
            by allow_neg_eigval; applied in fp32 before the op.
    Returns:
        o: [B, T, HV, V] in q's dtype; final_state: [N, HV, K, V] fp32, or None unless
        output_final_state.
    """
    g, beta = apply_transforms("chunk_gated_delta_rule", g, beta,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval)
    if cp_group is not None:
        return context_parallel.chunk_context_parallel(
            "gated_delta_rule", chunk_gated_delta_rule, cp_group, q, k, v, g=g,
            beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, impl=impl)
    return run_op(OPS["chunk_gated_delta_rule"], CHUNK_IMPLS, impl, q=q, k=k, v=v,
                  g=g, beta=beta, initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None,
                                     use_qk_l2norm_in_kernel=False, impl="auto",
                                     *, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Token-by-token gated delta rule (FLA's signature); same arguments and returns as
    `chunk_gated_delta_rule`. Its kernel suits decoding and short sequences."""
    g, beta = apply_transforms("fused_recurrent_gated_delta_rule", g, beta,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval)
    return run_op(OPS["fused_recurrent_gated_delta_rule"], RECURRENT_IMPLS, impl, q=q, k=k, v=v,
                  g=g, beta=beta, initial_state=initial_state, scale=scale,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
