"""Run one fla_jax op on harness inputs (under jax.jit, cu_seqlens traced); return outputs
and gradients as float64 numpy."""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from .cases import ACTIVATION, Case, OpSpec, op_kwargs

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32,
          "fp64": jnp.float64}


def registry(spec: OpSpec) -> dict:
    mod = importlib.import_module(f"fla_jax.ops.{spec.family}.interface")
    if not spec.has_state:
        return mod.IMPLS
    return mod.CHUNK_IMPLS if spec.variant == "chunk" else mod.RECURRENT_IMPLS


def unsupported(spec: OpSpec, case: Case, impl: str, dtype: str) -> str | None:
    """Why `impl` cannot take (spec, case, dtype), or None. Only impl='mosaic' has limits of its
    own (dtype, head sizes, grid): the family's `mosaic_unsupported_reason`, asked with shape
    stand-ins of q, k, v (and cu_seqlens) of the case."""
    if impl != "mosaic":
        return None
    from fla_jax.ops.common.mosaic.lowering import on_hopper
    if not on_hopper():
        return (f"no Hopper GPU here (jax backend {jax.default_backend()}); the Mosaic "
                f"kernels need sm_90")
    mod = importlib.import_module(f"fla_jax.ops.{spec.family}")
    reason = getattr(mod, "mosaic_unsupported_reason", None)
    if reason is None:
        return f"fla_jax.ops.{spec.family} has no Mosaic kernels"
    dt = DTYPES[dtype]
    heads = case.HV if spec.grouped_query else case.H
    q = jax.ShapeDtypeStruct((case.B, case.T, heads, case.K), dt)
    k = jax.ShapeDtypeStruct((case.B, case.T, case.H, case.K), dt)
    v = jax.ShapeDtypeStruct((case.B, case.T, case.HV, case.V), dt)
    cu = None if case.cu_seqlens is None else np.asarray(case.cu_seqlens, np.int32)
    return reason(q, k, v, cu_seqlens=cu)


def x64():
    """A context with float64 enabled in JAX."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    return jax.experimental.enable_x64()   # older jax


def run(spec: OpSpec, case: Case, impl: str, dtype: str, x: dict, device: str = "cpu",
        final_state: bool = True) -> dict:
    """x: float64 inputs already rounded to `dtype` (activations) / fp32 (gates, states).
    final_state=False: output_final_state=False, the op must return no final state.
    fp64: everything in float64, inside a jax.enable_x64 context (the rest of the process keeps
    JAX's defaults)."""
    if dtype == "fp64":
        with x64():
            return _run(spec, case, impl, dtype, x, final_state, jnp.float64)
    return _run(spec, case, impl, dtype, x, final_state, jnp.float32)


def _run(spec, case, impl, dtype, x, final_state, gdt) -> dict:
    """run(); gdt: the dtype of gates, betas and states (fp32, or fp64 for an fp64 run)."""
    import fla_jax.ops as ops

    dt = DTYPES[dtype]
    present = [a for a in spec.args if a.key in x]
    diff = [a for a in present if a.differentiable]   # traced and differentiated
    const = {a.name: jnp.asarray(np.asarray(x[a.key], np.float32)).astype(
        dt if a.role == ACTIVATION else gdt) for a in present if not a.differentiable}
    primals = [jnp.asarray(np.asarray(x[a.key], np.float32)).astype(
        dt if a.role == ACTIVATION else gdt) for a in diff]
    static = op_kwargs(spec, case)
    if not final_state:
        static["output_final_state"] = False
    cu = None if case.cu_seqlens is None else jnp.asarray(case.cu_seqlens, jnp.int32)
    fn = getattr(ops, spec.name)

    def forward(cu_seqlens, *args):
        kw = dict(static, **const, **{a.name: t for a, t in zip(diff, args)})
        if spec.state_tuple:   # the state parts travel as one initial_state tuple (GSA)
            parts = tuple(kw.pop(a.name, None) for a in spec.states)
            if any(p is not None for p in parts):
                kw["initial_state"] = parts
        if cu_seqlens is not None:
            kw["cu_seqlens"] = cu_seqlens
        return fn(**kw, impl=impl)

    @jax.jit
    def fwd_bwd(cu_seqlens, do, dht, *args):
        if not spec.has_state:   # softmax attention returns o only
            o, vjp = jax.vjp(lambda *a: forward(cu_seqlens, *a), *args)
            return o, None, vjp(do.astype(o.dtype))
        (o, ht), vjp = jax.vjp(lambda *a: forward(cu_seqlens, *a), *args)
        if ht is None:
            return o, None, vjp((do.astype(o.dtype), None))
        dht = jax.tree_util.tree_map(lambda c, h: c.astype(h.dtype), dht, ht)
        return o, ht, vjp((do.astype(o.dtype), dht))

    do = jnp.asarray(np.asarray(x["do"], np.float32)).astype(dt)
    keys = [a.final_key for a in spec.states]
    dht = [jnp.asarray(x["d" + n], gdt) for n in keys if "d" + n in x]
    dht = (tuple(dht) if spec.state_tuple else dht[0]) if dht else None
    o, ht, grads = fwd_bwd(cu, do, dht, *primals)
    if impl == "mosaic" and spec.has_state:
        # a differentiated Mosaic call may run other forward kernels (the GDN's Pallas backward
        # needs the Pallas forward's residuals): o and the final state of the Mosaic forward
        # kernels come from a plain call, as inference gets them
        o, ht = jax.jit(forward)(cu, *primals)
    if not final_state and ht is not None:
        raise AssertionError(f"{spec.name}(impl={impl}): a final state although "
                             f"output_final_state=False")
    if o.dtype != dt:
        raise AssertionError(f"{spec.name}(impl={impl}): o has dtype {o.dtype}; expected {dt}")
    finals = {} if ht is None else dict(zip(keys, ht if spec.state_tuple else (ht,)))
    for n, t in finals.items():
        if t.dtype != gdt:
            raise AssertionError(f"{spec.name}(impl={impl}): final state {n} has dtype "
                                 f"{t.dtype}; expected {jnp.dtype(gdt).name}")
    out = {"o": o, **finals}
    for a, p, gr in zip(diff, primals, grads):
        key = "d" + a.key
        if gr.dtype != p.dtype:
            raise AssertionError(f"{spec.name}(impl={impl}): {key} has dtype {gr.dtype}; "
                                 f"expected its input's {p.dtype}")
        out[key] = gr
    wide = jnp.float64 if gdt == jnp.float64 else jnp.float32   # numpy has no bf16
    return {n: np.asarray(jnp.asarray(a, wide), np.float64) for n, a in out.items()}
