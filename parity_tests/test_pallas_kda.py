"""Kernel tests of the Pallas chunk_kda on the delta-rule stages (fla_jax/ops/kda/pallas_chunk.py:
engine delta_scores, wy, delta_prep, delta_state and the engine's output stage / output_grads) on CPU,
interpreted: the features test_ops' kernel subset does not reach, as a case list on the shared
harness (cases.PALLAS_KDA_CASES, harness.check: the fp64 oracle, jax_runner under jax.jit with
traced cu_seqlens, cases.rel_rms and THE tolerance table; o, ht and every gradient).

Rows: every gate -20 per token and channel over varlen sequences crossing chunks (fp16: exp(b)
is far below fp16's range there, the relative kb / w / q exp(b) keep it; fp32: the per-pair
diagonal sub-blocks), grouped value heads with l2norm and an empty sequence (bf16), no initial
state with K, V not powers of two (fp16), K = V = 256 (fp32), output_final_state=False; plus
the named errors of K, V > 256. The DPLR route (chunk_kda_pallas_dplr) keeps its rows in
test_pallas_dplr.py.
"""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from .harness import assert_passed, check, check_no_final_state

PALLAS = {"jax": "pallas"}
ROWS = [("pkda_all_minus20_varlen", "fp16"), ("pkda_all_minus20_varlen", "fp32"),
        ("pkda_gqa_l2_varlen", "bf16"), ("pkda_no_h0_k48_v32", "fp16"),
        ("pkda_kv256", "fp32"), ("pkda_k144_v160", "fp32")]


@pytest.mark.parametrize("case,dtype", [pytest.param(*r, id=f"{r[0]}-{r[1]}") for r in ROWS])
def test_pallas_kda(case, dtype):
    assert_passed(check("chunk_kda", case, dtype, PALLAS))


def test_pallas_kda_no_final_state():
    assert_passed(check_no_final_state("chunk_kda", "pkda_gqa_l2_varlen", "fp32", PALLAS))


@pytest.mark.parametrize("name,K,V", [("K", 320, 32), ("V", 32, 512)])
def test_pallas_kda_head_size_error_names_argument(name, K, V):
    from fla_jax.ops.kda.pallas_chunk import chunk_kda_pallas
    q = jnp.zeros((1, 8, 1, K), jnp.bfloat16)
    v = jnp.zeros((1, 8, 1, V), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"head size {name}="):
        chunk_kda_pallas(q, q, v, g=jnp.zeros((1, 8, 1, K)), beta=jnp.ones((1, 8, 1)),
                         scale=1.0, initial_state=None, output_final_state=False,
                         cu_seqlens=None)


def test_registry_points_at_delta_stages():
    from fla_jax.ops.kda.interface import CHUNK_IMPLS
    assert CHUNK_IMPLS["pallas"] == "fla_jax.ops.kda.pallas_chunk:chunk_kda_pallas"


# bytes of one kernel's serialized Triton IR in the module lowered for cuda (the DPLR kernels'
# bound is 80k: unrolled loops of 6k-24k TTIR lines did not compile within 10 minutes on the
# H100 host)
MAX_KERNEL_IR = 100_000
KDA_KERNELS = {"kda_delta_scores", "kda_delta_scores_fix", "kda_wy_fwd", "kda_state_fwd",
               "engine_output_fwd_given", "kda_state_prep_bwd", "kda_state_bwd",
               "engine_output_intra", "engine_output_intra_fix", "engine_output_inter",
               "kda_wy_bwd"}


def _kernel_ir_sizes(K: int) -> dict:
    import re

    import jax

    from fla_jax.ops.common.dispatch import compiled_for_gpu
    from fla_jax.ops.kda.pallas_chunk import chunk_kda_pallas
    B, T, H = 1, 130, 2
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    x = {"q": S((B, T, H, K), bf), "k": S((B, T, H, K), bf), "v": S((B, T, H, K), bf),
         "g": S((B, T, H, K), f32), "beta": S((B, T, H), f32), "h0": S((B, H, K, K), f32)}

    def loss(x):
        o, ht = chunk_kda_pallas(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=1.0,
                                 initial_state=x["h0"], output_final_state=True,
                                 cu_seqlens=None)
        return jnp.sum(o.astype(f32)) + jnp.sum(ht)

    with compiled_for_gpu():
        text = jax.jit(jax.value_and_grad(loss)).trace(x).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r'custom_call @__gpu\$xla\.gpu\.triton.*?ir = "([^"]*)".*?name = "([^"]*)"',
                       text)
    return {name: len(ir) for ir, name in calls}


def test_pallas_kda_kernels_ir_small_and_independent_of_k():
    small, large = _kernel_ir_sizes(32), _kernel_ir_sizes(128)
    assert set(small) == set(large) == KDA_KERNELS, (small, large)
    too_big = {n: s for n, s in large.items() if s > MAX_KERNEL_IR}
    assert not too_big, f"kernel IR over {MAX_KERNEL_IR} bytes at K=128: {too_big}"
    grown = {n: (small[n], large[n]) for n in small if large[n] > 1.1 * small[n]}
    assert not grown, f"kernel IR grows with K (K=32, K=128 bytes): {grown}"
