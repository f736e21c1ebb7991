"""Validate and normalise the arguments of a public op, then call the chosen implementation.

Every public op in fla_jax.ops goes through `run_op`, so every op applies the same
contract: shared activation dtype, fp32 gates/states, default scale, checked cu_seqlens.
Works under jax.jit: shapes and dtypes are checked at trace time; cu_seqlens values are
checked when cu_seqlens is concrete (a traced cu_seqlens is trusted).
"""
from __future__ import annotations

import jax
import numpy as np

from fla_contract import check_cu_seqlens_values, check_head_dims, check_scale, validate_op

from ... import dtypes
from .dispatch import ALLOWED_DTYPES, KERNEL_IMPL, load_impl, resolve_impl


def concrete_values(x):
    """numpy values of x, or None when x is traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def run_op(op: str, registry: dict, impl: str, q, k, v, *, family_args: tuple,
           g=None, g_kind: str = "scalar", beta=None, g_gamma=None, scale=None,
           initial_state=None, output_final_state: bool = False, cu_seqlens=None,
           grouped_heads: bool = False, use_qk_l2norm_in_kernel: bool = False):
    """Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None)."""
    name = resolve_impl(op, impl, registry, q)
    dims = validate_op(
        op, name, ALLOWED_DTYPES[name], dtypes.info("q", q), dtypes.info("k", k),
        dtypes.info("v", v), g=dtypes.info("g", g), g_kind=g_kind, beta=dtypes.info("beta", beta),
        g_gamma=dtypes.info("g_gamma", g_gamma),
        initial_state=dtypes.info("initial_state", initial_state),
        cu_seqlens=dtypes.info("cu_seqlens", cu_seqlens), grouped_heads=grouped_heads)
    if cu_seqlens is not None:
        values = concrete_values(cu_seqlens)
        if values is not None:
            check_cu_seqlens_values(op, values.tolist(), dims.T)
    if name == KERNEL_IMPL:
        check_head_dims(op, name, dims.K, dims.V)
    scale = dims.K ** -0.5 if scale is None else check_scale(op, scale)

    gd = dtypes.gate_dtype(q.dtype)
    extra = {"g": None if g is None else g.astype(gd),
             "beta": None if beta is None else beta.astype(gd),
             "g_gamma": None if g_gamma is None else g_gamma.astype(gd),
             "use_qk_l2norm_in_kernel": bool(use_qk_l2norm_in_kernel)}
    kwargs = {key: extra[key] for key in family_args}
    fn = load_impl(registry, name)
    o, final_state = fn(q, k, v, **kwargs, scale=scale, initial_state=initial_state,
                        output_final_state=bool(output_final_state), cu_seqlens=cu_seqlens)
    return o, (final_state if output_final_state else None)
