"""chunk_gated_delta_rule / chunk_delta_rule impl='mosaic' (Pallas Mosaic GPU kernels) on a
CPU machine.

- Lowering: the forward kernel (and the vjp with either backward: mosaic_chunk.BACKWARD
  "mosaic", the default, or "pallas", the Pallas Triton-lowering kernels) lowers for CUDA with jax.export for
  K = V in {64, 128, 256}, bf16/fp16, h0, varlen, GQA.
- Numerics: JAX's GPU interpret mode (common/mosaic/tiles.gpu_interpret) runs the forward
  kernel against the float64 reference of test_pallas_delta (every output and gradient):
  indices, packing, pipelining and masking; not the register layouts of a real GPU.
- Dispatch: what impl='mosaic' raises off a Hopper GPU; the unsupported reasons.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fla_jax.ops.common.mosaic import export_for_cuda
from fla_jax.ops.common.mosaic.tiles import gpu_interpret
from fla_jax.ops.delta_rule import chunk_delta_rule
from fla_jax.ops.delta_rule.mosaic_chunk import chunk_delta_rule_mosaic
from fla_jax.ops.gated_delta_rule import (chunk_gated_delta_rule, mosaic_chunk,
                                           mosaic_unsupported_reason)
from fla_jax.ops.gated_delta_rule.mosaic_chunk import chunk_gated_delta_rule_mosaic

from .test_pallas_delta import _compare, _inputs

S = jax.ShapeDtypeStruct
DT = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def _lower(K, dtype, varlen, backward, gated=True, T=300, H=2, HV=4):
    B, N = (1, 3) if varlen else (2, 2)
    dt = DT[dtype]
    args = [S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, HV, K), dt),
            S((B, T, HV), jnp.float32), S((B, T, HV), jnp.float32),
            S((N, HV, K, K), jnp.float32)]
    args += [S((N + 1,), jnp.int32)] if varlen else []

    def f(q, k, v, g, beta, h0, cu=None):
        if gated:
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                          output_final_state=True, cu_seqlens=cu,
                                          use_qk_l2norm_in_kernel=True, impl="mosaic")
        return chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True,
                                cu_seqlens=cu, impl="mosaic")

    fn = f
    if backward:
        def fn(*a):
            (o, ht), vjp = jax.vjp(f, *a)
            return o, ht, vjp((jnp.ones_like(o), jnp.ones_like(ht)))
    return export_for_cuda(fn, *args)


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_lowers(K, dtype):
    assert "mosaic_gpu" in _lower(K, dtype, varlen=False, backward=False)


@pytest.fixture
def mosaic_backward(monkeypatch):
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")


@pytest.mark.parametrize("gated", [True, False])
def test_varlen_vjp_lowers(gated, monkeypatch):
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "pallas")
    text = _lower(128, "bf16", varlen=True, backward=True, gated=gated)
    assert "mosaic_gpu" in text and "triton" in text


@pytest.mark.parametrize("K", [64, 256])
def test_mosaic_backward_lowers(K, mosaic_backward):
    text = _lower(K, "bf16", varlen=K == 64, backward=True)
    assert "mosaic_gpu" in text and "triton" not in text


CASES = {
    # several chunks, a tail, GQA, h0, l2norm, strong gates, beta in (0, 2)
    "gqa_h0_t100": dict(B=2, T=100, H=1, HV=2, K=64, V=64, cu=None, g_min=-5,
                        beta=(0.0, 2.0), h0=True, l2norm=True),
    # varlen with an empty sequence and a sequence ending mid-chunk; V = 128 (2 value blocks)
    "varlen": dict(B=1, T=140, H=1, HV=1, K=64, V=128, cu=[0, 7, 7, 100, 140], g_min=0,
                   beta=(0.05, 0.95), h0=True, l2norm=False),
}


@pytest.mark.parametrize("family,case,backward", [
    ("gdn", "gqa_h0_t100", "pallas"), ("gdn", "varlen", "mosaic"),
    ("delta", "gqa_h0_t100", "mosaic")])
def test_interpreted_against_float64(case, family, backward, monkeypatch):
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", backward)
    c = CASES[case]
    gated = family == "gdn"
    N = c["B"] if c["cu"] is None else len(c["cu"]) - 1
    x = _inputs(7, c["B"], c["T"], c["H"], c["HV"], c["K"], c["V"], N, gated, c["beta"],
                c["g_min"], c["h0"])
    if not c["l2norm"]:
        x["k"] = x["k"] / np.sqrt(c["K"])
    fn = chunk_gated_delta_rule_mosaic if gated else chunk_delta_rule_mosaic
    with gpu_interpret():
        _compare(fn, x, "bf16", f"mosaic/{family}/{case}/{backward}", gated=gated,
                 scale=c["K"] ** -0.5,
                 l2norm=c["l2norm"], cu=c["cu"], h0=c["h0"])


def test_mosaic_needs_hopper():
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    b = jnp.ones((1, 64, 1), jnp.float32)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        chunk_gated_delta_rule(q, q, q, b, b, impl="mosaic")
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        chunk_delta_rule(q, q, q, b, impl="mosaic")


def test_unsupported_reasons():
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    assert mosaic_unsupported_reason(q, q, q) is None
    assert "impl='pallas'" in mosaic_unsupported_reason(q.astype(jnp.float32), q, q)
    odd = jnp.zeros((1, 64, 1, 96), jnp.bfloat16)
    assert "K=96" in mosaic_unsupported_reason(odd, odd, q)
    big = jnp.zeros((1, 64, 1, 512), jnp.bfloat16)
    assert "V=512" in mosaic_unsupported_reason(q, q, big)
