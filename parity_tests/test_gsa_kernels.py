"""GSA chunk kernels (Triton chunk_gsa and Pallas chunk_gsa, both on the chunk engine): the
cases that test_ops.py's CPU kernel subset leaves out, on the shared harness (cases.Case,
harness.check: the float64 oracle, NaN-poisoned allocations, the one tolerance table), each
framework against float64 and against each other.

Covered here: varlen with an empty sequence and no initial state, grouped query heads with
M != K != V (M = 24, not a power of two), g None (FLA's additive gate from the slot logits),
slot gates of -20 over two chunks; and the Pallas kernels lowered for the GPU (Triton lowering)
in bf16 with varlen. Interpreted on CPU, or on a GPU with PARITY_DEVICE=cuda.
"""
from __future__ import annotations

import os

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import triton  # noqa: E402,F401  (the suite needs every framework: no silent skip)

from parity_tests import triton_interpret_patch  # noqa: E402
from parity_tests.harness import check  # noqa: E402

triton_interpret_patch.apply()

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"
BOTH = {"jax": "pallas", "torch": "triton"}
CASES = [pytest.param("tgsa_varlen_gqa", "bf16", BOTH, id="tgsa_varlen_gqa-bf16"),
         pytest.param("tgsa_no_gate", "fp32", BOTH, id="tgsa_no_gate-fp32"),
         pytest.param("tgsa_strong", "fp32", BOTH, id="tgsa_strong-fp32"),
         pytest.param("tgsa_strong", "fp16", {"torch": "triton"}, id="tgsa_strong-fp16-triton"),
         pytest.param("tgsa_strong", "fp16", {"jax": "pallas"}, id="tgsa_strong-fp16-pallas")]


@pytest.mark.parametrize("case,dtype,impls", CASES)
def test_chunk_gsa_kernels(case, dtype, impls):
    rows = check("chunk_gsa", case, dtype, impls, device=DEVICE)
    bad = [f"{r.compared} {r.tensor} err={r.error:.3e} tol={r.tolerance:.1e}"
           for r in rows if not r.passed]
    assert rows and not bad, "\n".join(bad)


@pytest.mark.parametrize("variant", ["chunk", "recurrent"])
def test_pallas_gsa_lowers_for_gpu(variant):
    """Forward and backward of the Pallas GSA kernels lower for cuda (varlen, bf16, GQA)."""
    import jax
    import jax.numpy as jnp

    from fla_jax.ops.common.dispatch import compiled_for_gpu
    from fla_jax.ops.gsa.pallas_chunk import chunk_gsa_pallas
    from fla_jax.ops.gsa.pallas_recurrent import fused_recurrent_gsa_pallas

    fn = chunk_gsa_pallas if variant == "chunk" else fused_recurrent_gsa_pallas

    B, T, HQ, H, K, V, M = 1, 200, 4, 2, 64, 64, 64
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    x = {"q": S((B, T, HQ, K), bf), "k": S((B, T, H, K), bf), "v": S((B, T, H, V), bf),
         "s": S((B, T, H, M), bf), "g": S((B, T, H, M), f32), "hk0": S((3, H, K, M), f32),
         "hv0": S((3, H, M, V), f32)}
    cu = jnp.asarray([0, 50, 120, 200], jnp.int32)

    def loss(x):
        o, (hk, hv) = fn(x["q"], x["k"], x["v"], x["s"], g=x["g"], scale=K ** -0.5,
                         initial_state=(x["hk0"], x["hv0"]), output_final_state=True,
                         cu_seqlens=cu)
        return jnp.sum(o.astype(f32)) + jnp.sum(hk) + jnp.sum(hv)

    with compiled_for_gpu():
        lowered = jax.jit(jax.value_and_grad(loss)).trace(x).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower(), "no Triton kernel call in the lowered module"


def test_kernel_head_sizes_checked_once():
    """run_op checks every head-size symbol of the OpSpec for the kernels (GSA's slot count M
    included): a named ValueError before any kernel is traced."""
    import jax.numpy as jnp

    import fla_jax.ops as jops
    q = jnp.ones((1, 8, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"chunk_gsa\(impl='pallas'\): head size M=300; this "
                                         r"implementation supports M <= 256"):
        jops.chunk_gsa(q, q, q, jnp.ones((1, 8, 1, 300), jnp.float32), impl="pallas")
    with pytest.raises(ValueError, match="head size V=300"):
        jops.fused_recurrent_gsa(q, q, jnp.ones((1, 8, 1, 300), jnp.float32), q, impl="pallas")
