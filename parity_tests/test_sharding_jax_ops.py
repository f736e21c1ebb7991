"""fla_jax ops on batch/head-sharded inputs (4 virtual CPU devices, a (data, model) = (2, 2)
mesh): the default path (impl='auto' = chunked on CPU) and softmax attention
under jax.jit with sharded inputs give the unsharded results (outputs, final states, every
gradient, fp32 within 1e-5), and XLA partitions them without gathering: the compiled program
holds no all-gather / all-to-all / collective-permute, only the loss's all-reduce. Pallas
kernels: test_sharding_jax_kernels.py."""
from __future__ import annotations

import os

import pytest

from .multi_device import SHARDING_MODULES, in_child, run_module_in_child

if not in_child():
    def test_on_four_devices():
        """This module's tests and those of test_sharding_jax_kernels.py and
        test_sharding_jax_layers.py, in one child (multi_device.SHARDING_MODULES; conftest.py
        deselects those modules' own parent tests when this one is collected)."""
        here = os.path.dirname(os.path.abspath(__file__))
        # the three modules each had 300 s
        print(run_module_in_child([os.path.join(here, m) for m in SHARDING_MODULES],
                                  timeout=900))
else:
    from .cases import Case
    from .sharding_jax import assert_same, collectives, mesh, run

    FAMILIES = ("simple_gla", "gla", "delta_rule", "gated_delta_rule")
    # GQA for the delta family: H = 2 q/k heads over HV = 4 value heads, split in two.
    CASES = {"simple_gla": Case("s", B=2, T=40, K=16, V=16),
             "gla": Case("s", B=2, T=40, K=16, V=16),
             "delta_rule": Case("s", B=2, T=40, H=2, HV=4, K=16, V=16, l2norm=True),
             "gated_delta_rule": Case("s", B=2, T=40, H=2, HV=4, K=16, V=16, l2norm=True)}
    ATTN = Case("a", B=2, T=40, H=2, HV=4, K=16, V=16)

    @pytest.mark.parametrize("family", FAMILIES)
    def test_chunked_partitions_through_xla(family):
        op, case = f"chunk_{family}", CASES[family]
        ref = run(op, case, "auto")
        out = run(op, case, "auto", mesh())
        assert_same(ref, out, f"{op} sharded (auto)")
        assert collectives(out[2]) <= {"all-reduce"}, collectives(out[2])

    def test_attention_partitions_through_xla():
        ref = run("attention", ATTN, "auto")
        out = run("attention", ATTN, "auto", mesh())
        assert_same(ref, out, "attention sharded")
        assert collectives(out[2]) <= {"all-reduce"}, collectives(out[2])

    def test_explicit_axes():
        """Explicit mesh axes: jnp code would need out_sharding on reshapes of sharded
        arrays; run_op runs the chunked impl per shard instead (ops/common/sharding.py)."""
        case = CASES["gated_delta_rule"]
        ref = run("chunk_gated_delta_rule", case, "auto")
        out = run("chunk_gated_delta_rule", case, "auto", mesh(explicit=True))
        assert_same(ref, out, "chunk_gated_delta_rule sharded (explicit)")
        assert collectives(out[2]) <= {"all-reduce"}, collectives(out[2])

    def test_varlen_heads_only():
        """cu_seqlens (B == 1): heads split, the batch axis replicates."""
        case = Case("v", B=1, T=60, H=2, HV=4, K=16, V=16, cu_seqlens=(0, 7, 40, 60))
        ref = run("chunk_gated_delta_rule", case, "auto")
        out = run("chunk_gated_delta_rule", case, "auto", mesh())
        assert_same(ref, out, "varlen sharded")
