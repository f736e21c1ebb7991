"""Public Gated DeltaNet ops: the delta rule with a scalar log-decay g [B, T, HV].

Recurrence per value head hv (q/k head hv // (HV // H)):
    S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t      S: [K, V], fp32
    o_t = scale * q_t S_t
With use_qk_l2norm_in_kernel, q and k are first normalised over K in fp32:
x / sqrt(sum(x^2) + 1e-6).
"""
from __future__ import annotations

from fla_contract import OPS

from ..common import context_parallel
from ..common.mosaic.dispatch import mosaic_or
from ..common.fla_inputs import apply_transforms
from ..common.prepare import run_op
from .mosaic_chunk import mosaic_unsupported_reason

_BASE = {"reference": "fla_jax.ops.gated_delta_rule.reference:gated_delta_rule_reference",
         "chunked": "fla_jax.ops.gated_delta_rule.chunked:gated_delta_rule_chunked"}
CHUNK_IMPLS = dict(_BASE)
CHUNK_IMPLS["pallas"] = "fla_jax.ops.gated_delta_rule.pallas_chunk:chunk_gated_delta_rule_pallas"
CHUNK_IMPLS["mosaic"] = "fla_jax.ops.gated_delta_rule.mosaic_chunk:chunk_gated_delta_rule_mosaic"
RECURRENT_IMPLS = dict(_BASE)
RECURRENT_IMPLS["pallas"] = "fla_jax.ops.gated_delta_rule.pallas_recurrent:fused_recurrent_gated_delta_rule_pallas"


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None,
                           use_qk_l2norm_in_kernel=False, impl="auto", cp_mesh_axis=None,
                           *, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Chunk-parallel gated delta rule (FLA's signature).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] with HV % H == 0; one dtype in {bf16, fp16,
            fp32} (fp64: reference, chunked). g: [B, T, HV] log-decay (<= 0) and
            beta: [B, T, HV], any float dtype, used in fp32. scale: float, default K ** -0.5.
            initial_state: [N, HV, K, V] fp32. cu_seqlens: [N+1] int, needs B == 1.
            use_qk_l2norm_in_kernel: L2-normalise q and k over K inside the op.
        impl: 'auto' | 'reference' | 'chunked' | 'pallas' | 'mosaic' (Pallas Mosaic GPU
            kernels: Hopper only, bf16/fp16, K and V multiples of 64 up to 256; 'auto' takes
            them on a Hopper GPU once proven there, see mosaic_unsupported_reason).
        cp_mesh_axis: context parallelism (the sequence split along T): the name of a mesh
            axis of the enclosing shard_map;
            see fla_jax/ops/common/context_parallel.py (cu_seqlens, initial_state and
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
    if cp_mesh_axis is not None:
        return context_parallel.chunk_context_parallel(
            "gated_delta_rule", chunk_gated_delta_rule, cp_mesh_axis, q, k, v, g=g,
            beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, impl=impl)
    impl = mosaic_or("chunk_gated_delta_rule", impl, q, lambda: mosaic_unsupported_reason(q, k, v))
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
