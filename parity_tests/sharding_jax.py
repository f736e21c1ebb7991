"""Sharded == unsharded for one fla_jax op: the same jitted value-and-grad, once on one device
and once with batch/head-sharded inputs on a (data, model) mesh of the child's virtual devices
(see multi_device.py). Inputs come from cases.make_inputs (fp32); the loss is
sum(o * do) + sum(final_state * dht), so its gradients are the op's vector-Jacobian products.
"""
from __future__ import annotations

import re

import numpy as np

from fla_contract import OPS

from .cases import Case, make_inputs, rel_rms

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

from fla_jax import ops  # noqa: E402

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")
HEADS = ("H", "HV", "HQ", "HKV")


def mesh(explicit: bool = False, shape=(2, 2)):
    t = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, ("data", "model"), axis_types=(t, t))


def partition(symbols: tuple, varlen: bool) -> PartitionSpec:
    """B (N without varlen) over 'data', heads over 'model'."""
    def axis(s):
        if s == "B" or (s == "N" and not varlen):
            return None if varlen else "data"
        return "model" if s in HEADS else None
    return PartitionSpec(*(axis(s) for s in symbols))


def inputs(op: str, case: Case, seed: int = 0):
    """(tensors {public name: fp32 array}, cotangents {'do', 'dht'})."""
    spec = OPS[op]
    x = make_inputs(spec, case, seed)
    tensors = {a.name: jnp.asarray(x[a.key], jnp.float32) for a in spec.args if a.key in x}
    cots = {n: jnp.asarray(x[n], jnp.float32) for n in ("do", "dht") if n in x}
    return tensors, cots


def loss_fn(op: str, case: Case, impl: str, cots: dict):
    spec = OPS[op]
    extra = {}
    if spec.l2norm:
        extra["use_qk_l2norm_in_kernel"] = case.l2norm
    if case.cu_seqlens is not None:
        extra["cu_seqlens"] = jnp.asarray(case.cu_seqlens, jnp.int32)

    def loss(tensors):
        if not spec.has_state:
            o = getattr(ops, op)(**tensors, impl=impl, **extra)
            return jnp.sum(o * cots["do"]), {"o": o}
        o, ht = getattr(ops, op)(**tensors, impl=impl, output_final_state=True, **extra)
        return jnp.sum(o * cots["do"]) + jnp.sum(ht * cots["dht"]), {"o": o, "ht": ht}
    return loss


def grad_args(op: str, tensors: dict) -> dict:
    """The differentiable tensors (g_gamma is not)."""
    spec = OPS[op]
    return {n: t for n, t in tensors.items() if spec.arg(n).differentiable}


def run(op: str, case: Case, impl: str, the_mesh=None, context=None):
    """(loss, {'o', 'ht', 'd<name>': numpy}, compiled HLO text) of the jitted value-and-grad; sharded over the_mesh
    when given (context: a context manager to trace and run it in)."""
    tensors, cots = inputs(op, case)
    diff = grad_args(op, tensors)
    fixed = {n: t for n, t in tensors.items() if n not in diff}
    base = loss_fn(op, case, impl, cots)

    def f(d, fixed):
        return base({**d, **fixed})
    fn = jax.jit(jax.value_and_grad(f, has_aux=True))
    if the_mesh is not None:
        varlen = case.cu_seqlens is not None
        spec = OPS[op]

        def put(tree):
            return {n: jax.device_put(t, NamedSharding(the_mesh, partition(spec.arg(n).shape,
                                                                            varlen)))
                    for n, t in tree.items()}
        diff, fixed = put(diff), put(fixed)
    import contextlib
    with context if context is not None else contextlib.nullcontext():
        compiled = fn.lower(diff, fixed).compile()
        (loss, outs), grads = compiled(diff, fixed)
    got = {n: np.asarray(t) for n, t in outs.items()}
    got.update({"d" + n: np.asarray(g) for n, g in grads.items()})
    return float(loss), got, compiled.as_text()


def collectives(hlo: str) -> set:
    return set(re.findall("|".join(COLLECTIVES), hlo))


def assert_same(ref, out, what: str, tol: float = 1e-5):
    (l0, g0, _), (l1, g1, _) = ref, out
    assert abs(l0 - l1) <= tol * max(1.0, abs(l0)), f"{what}: loss {l0} vs {l1}"
    assert set(g0) == set(g1)
    for n in g0:
        err = rel_rms(g1[n], g0[n], g0[n])
        assert err <= tol, f"{what}: {n} rel RMS {err:.2e} > {tol:g}"
