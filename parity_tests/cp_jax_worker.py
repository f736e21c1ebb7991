"""Run the JAX context-parallel cases on 4 virtual CPU devices and save the results.

`python -m parity_tests.cp_jax_worker OUT_DIR` (test_context_parallel_jax.py runs it in a
subprocess: the device count must be set before jax initialises its backend). The runs:
cp_cases.jax_runs(). Each run:
the op inside `jax.shard_map` over a mesh axis "cp" (q, k, v, g, beta split along T;
cu_seqlens, g_gamma, initial_state replicated), `cp_mesh_axis="cp"`, forward and vjp under
jax.jit; saves o, ht and every gradient (global) as OUT_DIR/<run id>-w<world>.npz.
"""
from __future__ import annotations

import os
import sys

from parity_tests import CPU_XLA_FLAGS

DEVICES = 4
# CPU compile time dominates; the suite's XLA flags (parity_tests.CPU_XLA_FLAGS) as well.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", CPU_XLA_FLAGS)
                           + f" --xla_force_host_platform_device_count={DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from parity_tests import cp_cases  # noqa: E402
from parity_tests.cases import ACTIVATION, op_kwargs  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
AXIS = "cp"


def round_to(dtype, a):
    """float64 values of a stored in dtype (via fp32, as the harness does)."""
    return np.asarray(jnp.asarray(np.asarray(a, np.float32)).astype(DTYPES[dtype]),
                      np.float64)


def cp_run(spec, case, dtype, x, world) -> dict:
    import fla_jax.ops as ops

    dt = DTYPES[dtype]
    mesh = Mesh(np.array(jax.devices()[:world]), (AXIS,))
    present = [a for a in spec.args if a.key in x]
    diff = [a for a in present if a.differentiable]
    const = [a for a in present if not a.differentiable]

    def arr(a):
        return jnp.asarray(np.asarray(x[a.key], np.float32)).astype(
            dt if a.role == ACTIVATION else jnp.float32)

    def spec_of(a):
        return P(None, AXIS) if a.role in cp_cases.PER_TOKEN else P()

    static = op_kwargs(spec, case)
    cu = None if case.cu_seqlens is None else jnp.asarray(case.cu_seqlens, jnp.int32)
    fn = getattr(ops, spec.name)

    def local(cu_seqlens, consts, *args):
        kw = dict(static, **{a.name: t for a, t in zip(const, consts)},
                  **{a.name: t for a, t in zip(diff, args)})
        if cu_seqlens is not None:
            kw["cu_seqlens"] = cu_seqlens
        return fn(**kw, impl="chunked", cp_mesh_axis=AXIS)

    sharded = jax.shard_map(
        local, mesh=mesh,
        in_specs=(None if cu is None else P(), tuple(P() for _ in const),
                  *(spec_of(a) for a in diff)),
        out_specs=(P(None, AXIS), P()))

    @jax.jit
    def fwd_bwd(cu_seqlens, consts, do, dht, *args):
        (o, ht), vjp = jax.vjp(lambda *a: sharded(cu_seqlens, consts, *a), *args)
        return o, ht, vjp((do.astype(o.dtype), dht))

    do = jnp.asarray(np.asarray(x["do"], np.float32)).astype(dt)
    dht = jnp.asarray(x["dht"], jnp.float32)
    o, ht, grads = fwd_bwd(cu, tuple(arr(a) for a in const), do, dht,
                           *(arr(a) for a in diff))
    out = {"o": o, "ht": ht}
    for a, gr in zip(diff, grads):
        if gr.dtype != arr(a).dtype:
            raise AssertionError(f"{spec.name}: d{a.key} has dtype {gr.dtype}")
        out["d" + a.key] = gr
    return {n: np.asarray(jnp.asarray(t, jnp.float32), np.float64) for n, t in out.items()}


def main(out_dir):
    for world, case, spec, dtype in cp_cases.jax_runs():
        x = cp_cases.inputs(spec, case, dtype, round_to)
        res = cp_run(spec, case, dtype, x, world)
        np.savez(os.path.join(out_dir, f"{cp_cases.run_id(case, spec, dtype)}-w{world}.npz"),
                 **res)


if __name__ == "__main__":
    main(sys.argv[1])
