"""Validate and normalise the arguments of a public op, then call the chosen implementation.

Every public op in fla_jax.ops goes through `run_op` with its OpSpec (fla_contract.op_spec),
so every op applies the same contract: shared activation dtype, fp32 gates/states, default
scale, checked cu_seqlens. Works under jax.jit: shapes and dtypes are checked at trace time;
cu_seqlens values are checked when cu_seqlens is concrete (a traced cu_seqlens is trusted).
"""
from __future__ import annotations

import jax
import numpy as np

from fla_contract import (OpSpec, check_cu_seqlens_values, check_head_dims, check_scale,
                          validate_op)
from fla_contract.op_spec import ACTIVATION, GATE_DTYPE, STATE

from ... import dtypes
from .dispatch import ALLOWED_DTYPES, KERNEL_IMPLS, load_impl, resolve_impl
from .sharding import shard_kernel


def concrete_values(x):
    """numpy values of x, or None when x is traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def impl_fn(spec: OpSpec, registry: dict, name: str, q, cu_seqlens, output_final_state):
    """The implementation `name`, wrapped for batch/head-sharded inputs where XLA cannot
    partition it by itself (sharding.shard_kernel: a Pallas call; any impl under Explicit
    mesh axes)."""
    return shard_kernel(spec, load_impl(registry, name), q, cu_seqlens, output_final_state,
                        kernel=name in KERNEL_IMPLS)


def run_op(spec: OpSpec, registry: dict, impl: str, *, scale=None,
           output_final_state: bool = False, cu_seqlens=None,
           use_qk_l2norm_in_kernel: bool = False, options=None, allowed=None, auto=None,
           check=None, **tensors):
    """tensors: the op's tensor arguments by public name (q, k, v, g, beta, g_gamma,
    initial_state; an op with OpSpec.state_tuple gives each part of its initial_state tuple
    by the part's name, e.g. hk0, hv0; None where not given). Returns (o [B, T, HV, V] in q's dtype,
    final_state [N, HV, K, V] fp32 or None); an op without a state (not spec.has_state) returns o.
    options: extra keywords for the implementation (checked by the op); allowed: {impl: q/k/v
    dtypes} for implementation names beyond dispatch.ALLOWED_DTYPES; auto: the op's own
    impl='auto' rule (see resolve_impl); check: the op's own checks, called with the
    call's Dims after validation."""
    op = spec.name
    q = tensors.get(spec.activations[0].name)
    name = resolve_impl(op, impl, registry, q, auto)
    dims = validate_op(spec, name, dict(ALLOWED_DTYPES, **(allowed or {}))[name],
                       {n: dtypes.info(spec.label(n), t, op) for n, t in tensors.items()},
                       dtypes.info("cu_seqlens", cu_seqlens, op))
    if cu_seqlens is not None:
        values = concrete_values(cu_seqlens)
        if values is not None:
            check_cu_seqlens_values(op, values.tolist(), dims.T)
    if name in KERNEL_IMPLS:
        check_head_dims(op, name, dims.sizes)
    scale = dims.K ** -0.5 if scale is None else check_scale(op, scale)
    if use_qk_l2norm_in_kernel and not spec.l2norm:
        raise TypeError(f"{op}: use_qk_l2norm_in_kernel=True; this op has no such option")

    if check is not None:
        check(dims)
    if not spec.has_state:
        fn = impl_fn(spec, registry, name, q, cu_seqlens, False)
        return fn(*(tensors[a.name] for a in spec.activations), scale=scale,
                  cu_seqlens=cu_seqlens, **(options or {}))

    gd = dtypes.gate_dtype(q.dtype)
    family = {}
    for a in spec.args:
        if a.role not in (ACTIVATION, STATE):
            t = tensors.get(a.name)
            family[a.name] = t.astype(gd) if t is not None and a.dtype == GATE_DTYPE else t
    if spec.l2norm:
        family["use_qk_l2norm_in_kernel"] = bool(use_qk_l2norm_in_kernel)
    states = {a.name: tensors.get(a.name) for a in spec.of_role(STATE)}
    if spec.state_tuple:   # the parts of one public initial_state tuple (GSA's (hk0, hv0))
        parts = tuple(states.values())
        states = {"initial_state": None if all(p is None for p in parts) else parts}
    fn = impl_fn(spec, registry, name, q, cu_seqlens, bool(output_final_state))
    o, final_state = fn(*(tensors[a.name] for a in spec.activations), **family, scale=scale,
                        **states, output_final_state=bool(output_final_state),
                        cu_seqlens=cu_seqlens)
    return o, (final_state if output_final_state else None)
