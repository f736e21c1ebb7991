"""Validate and normalise the arguments of a public op, then call the chosen implementation.

Every public op in fla_torch.ops goes through `run_op`, so every op applies the same
contract: shared activation dtype, fp32 gates/states, default scale, checked cu_seqlens.
"""
from __future__ import annotations

import torch

from fla_contract import check_cu_seqlens_values, check_head_dims, check_scale, validate_op

from ... import dtypes
from .dispatch import ALLOWED_DTYPES, KERNEL_IMPL, load_impl, resolve_impl


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
        check_cu_seqlens_values(op, cu_seqlens.detach().cpu().tolist(), dims.T)
    if name == KERNEL_IMPL:
        check_head_dims(op, name, dims.K, dims.V)
    scale = dims.K ** -0.5 if scale is None else check_scale(op, scale)
    for arg, t in (("k", k), ("v", v), ("initial_state", initial_state)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{op}: {arg} is on {t.device}; expected q's device {q.device}")

    gd = dtypes.gate_dtype(q.dtype)
    extra = {"g": None if g is None else g.to(gd),
             "beta": None if beta is None else beta.to(gd),
             "g_gamma": None if g_gamma is None else g_gamma.to(gd),
             "use_qk_l2norm_in_kernel": bool(use_qk_l2norm_in_kernel)}
    kwargs = {key: extra[key] for key in family_args}
    fn = load_impl(registry, name)
    o, final_state = fn(q, k, v, **kwargs, scale=scale, initial_state=initial_state,
                        output_final_state=bool(output_final_state), cu_seqlens=cu_seqlens)
    return o, (final_state if output_final_state else None)
