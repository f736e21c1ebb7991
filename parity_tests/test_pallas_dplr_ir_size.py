"""Compile size of the Pallas DPLR chunk pipeline (chunk_kda / chunk_rwkv7): each Triton
kernel's IR, lowered for the GPU on CPU, stays small and does not grow with the head size.

Python-unrolled loops over sub-chunks and K blocks made these kernels 6k-24k TTIR lines, which
XLA did not finish compiling within 10 minutes on an H100 host; their loops are
lax.fori_loop now (engine/dplr_scores.py). Nothing runs; no GPU is needed.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from fla_jax.ops.common.dispatch import compiled_for_gpu
from fla_jax.ops.rwkv7.pallas_chunk import chunk_rwkv7_pallas

# bytes of one kernel's serialized IR as it appears in the lowered module's text
MAX_KERNEL_IR = 80_000


def _kernel_ir_sizes(K: int) -> dict:
    B, T, H = 1, 130, 2
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    x = {"r": S((B, T, H, K), bf), "k": S((B, T, H, K), bf), "v": S((B, T, H, K), bf),
         "w": S((B, T, H, K), f32), "a": S((B, T, H, K), f32), "b": S((B, T, H, K), f32),
         "h0": S((B, H, K, K), f32)}

    def loss(x):
        o, ht = chunk_rwkv7_pallas(x["r"], x["k"], x["v"], w=x["w"], a=x["a"], b=x["b"],
                                   scale=1.0, initial_state=x["h0"], output_final_state=True,
                                   cu_seqlens=None)
        return jnp.sum(o.astype(f32)) + jnp.sum(ht)

    with compiled_for_gpu():
        text = jax.jit(jax.value_and_grad(loss)).trace(x).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r'custom_call @__gpu\$xla\.gpu\.triton.*?ir = "([^"]*)".*?name = "([^"]*)"',
                       text)
    return {name: len(ir) for ir, name in calls}


def test_dplr_kernels_ir_small_and_independent_of_k():
    small, large = _kernel_ir_sizes(32), _kernel_ir_sizes(128)
    assert set(small) == set(large) == {f"dplr_{stage}_{d}" for d in ("fwd", "bwd") for stage in
                                        ("scores", "scores_fix", "wy", "state", "output")}, (
        small, large)
    too_big = {n: s for n, s in large.items() if s > MAX_KERNEL_IR}
    assert not too_big, f"kernel IR over {MAX_KERNEL_IR} bytes at K=128: {too_big}"
    grown = {n: (small[n], large[n]) for n in small if large[n] > 1.1 * small[n]}
    assert not grown, f"kernel IR grows with K (K=32, K=128 bytes): {grown}"
