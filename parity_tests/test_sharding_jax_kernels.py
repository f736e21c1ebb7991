"""Pallas kernels (interpreted on CPU) on batch/head-sharded inputs, 4 virtual CPU devices:
run_op wraps the kernel call in one shard_map (fla_jax/ops/common/sharding.py), so under
jax.jit each device runs the kernels on its batch rows and heads, and the results (outputs,
final states, every gradient) equal the one-device run, fp32 within 1e-5. The axes come from
kernel_sharding() with Auto mesh axes, or from the inputs' types with Explicit axes."""
from __future__ import annotations

import pytest

from .multi_device import in_child, run_module_in_child

if not in_child():
    def test_on_four_devices():
        print(run_module_in_child(__file__))
else:
    from .cases import Case
    from .sharding_jax import assert_same, collectives, mesh, run

    from fla_jax.ops.common.sharding import kernel_sharding

    SMALL = Case("s", B=2, T=40, K=16, V=16)
    GQA = Case("s", B=2, T=40, H=2, HV=4, K=16, V=16, l2norm=True)
    OPS_CASES = (("chunk_simple_gla", SMALL), ("chunk_gla", SMALL),
                 ("chunk_delta_rule", GQA), ("chunk_gated_delta_rule", GQA))

    @pytest.mark.parametrize("op,case", OPS_CASES, ids=[o for o, _ in OPS_CASES])
    def test_kernel_sharded_auto_axes(op, case):
        m = mesh()
        ref = run(op, case, "pallas")
        out = run(op, case, "pallas", m, kernel_sharding(m, batch="data", heads="model"))
        assert_same(ref, out, f"{op} pallas sharded")
        assert collectives(out[2]) <= {"all-reduce"}, collectives(out[2])

    def test_kernel_sharded_explicit_axes_without_declaration():
        op, case = "fused_recurrent_gated_delta_rule", GQA
        ref = run(op, case, "pallas")
        out = run(op, case, "pallas", mesh(explicit=True))
        assert_same(ref, out, f"{op} pallas sharded (explicit)")
        assert collectives(out[2]) <= {"all-reduce"}, collectives(out[2])

    def test_kernel_varlen_heads_only():
        case = Case("v", B=1, T=60, K=16, V=16, cu_seqlens=(0, 7, 40, 60))
        m = mesh()
        ref = run("chunk_simple_gla", case, "pallas")
        out = run("chunk_simple_gla", case, "pallas", m,
                  kernel_sharding(m, batch="data", heads="model"))
        assert_same(ref, out, "chunk_simple_gla varlen pallas sharded")

    def test_indivisible_heads_named():
        import jax.numpy as jnp

        from fla_jax import ops
        q = jnp.ones((2, 20, 3, 16), jnp.float32)
        m = mesh()
        with kernel_sharding(m, batch="data", heads="model"):
            with pytest.raises(ValueError, match=r"chunk_simple_gla: q has H = 3, not "
                                                 r"divisible by the 2 devices"):
                ops.chunk_simple_gla(q, q, q, impl="pallas")
