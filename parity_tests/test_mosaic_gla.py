"""chunk_gla impl='mosaic' (a Pallas Mosaic GPU forward, the Pallas backward) on a CPU machine.

- Lowering: the forward kernel lowers for CUDA with jax.export (layouts, wgmma shapes, TMA,
  SMEM size) for K, V in {64, 128, 256}, bf16 / fp16, h0, varlen.
- Numerics: JAX's GPU interpret mode runs the kernel against the harness's float64 oracle
  (cases.MOSAIC_KERNEL_CASES mos_gla_*: varlen with an empty sequence, gates in [-20, -10]);
  the intra-chunk scores of mosaic_inputs.py against float64 directly under strong gates.
- Dispatch: not GPU-proven, so impl='auto' does not take it on Hopper; named errors.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fla_jax.ops.common.mosaic import dispatch as mdispatch
from fla_jax.ops.common.mosaic import export_for_cuda
from fla_jax.ops.common.mosaic.tiles import gpu_interpret
from fla_jax.ops.gla import chunk_gla, mosaic_inputs, mosaic_unsupported_reason

from .harness import assert_passed, check

S = jax.ShapeDtypeStruct
DT = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def _lower(K, V, dtype, varlen, T=300, H=2):
    B, N = (1, 3) if varlen else (2, 2)
    dt = DT[dtype]
    args = [S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, H, V), dt),
            S((B, T, H, K), jnp.float32), S((N, H, K, V), jnp.float32)]
    args += [S((N + 1,), jnp.int32)] if varlen else []

    def f(q, k, v, g, h0, cu=None):
        return chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         impl="mosaic")
    return export_for_cuda(f, *args)


@pytest.mark.parametrize("K,V,dtype,varlen", [(64, 64, "bf16", True), (128, 128, "fp16", False),
                                              (256, 64, "bf16", True), (64, 256, "fp16", False)])
def test_forward_lowers(K, V, dtype, varlen):
    text = _lower(K, V, dtype, varlen)
    assert "gla_fwd" in text and "mosaic_gpu" in text


@pytest.mark.parametrize("case,dtype", [("mos_gla_varlen", "bf16"), ("mos_gla_strong", "fp16")])
def test_interpreted_against_float64(case, dtype):
    with gpu_interpret():
        assert_passed(check("chunk_gla", case, dtype, {"jax": "mosaic"}))


def test_scores_against_float64_under_strong_gates():
    """A_ij = sum_c q_ic k_jc exp(b_ic - b_jc) (j <= i) with gates to -20 per token and
    channel: no overflow, within fp16 rounding of float64 (rel. RMS), zeros above the
    diagonal."""
    rng = np.random.default_rng(3)
    C, H, K = 64, 2, 64
    q = rng.standard_normal((2 * C, H, K))
    k = rng.standard_normal((2 * C, H, K))
    g = -rng.uniform(0.0, 20.0, (2 * C, H, K)) * (rng.uniform(size=(1, 1, K)) < 0.3)
    b = np.asarray(mosaic_inputs.chunk_gates(jnp.asarray(g, jnp.float32), C), np.float64)
    got = np.asarray(mosaic_inputs.scores(jnp.asarray(q, jnp.float16),
                                          jnp.asarray(k, jnp.float16),
                                          jnp.asarray(b, jnp.float32), jnp.float16), np.float64)
    qf = np.asarray(jnp.asarray(q, jnp.float16), np.float64).reshape(2, C, H, K)
    kf = np.asarray(jnp.asarray(k, jnp.float16), np.float64).reshape(2, C, H, K)
    expo = b[:, :, None] - b[:, None, :]                                   # [n, i, j, H, K]
    causal = np.tril(np.ones((C, C), bool))[None, :, :, None, None]
    ref = np.sum(qf[:, :, None] * kf[:, None] * np.exp2(np.where(causal, expo, -np.inf)), -1)
    ref = ref.transpose(3, 0, 1, 2).reshape(H, 2 * C, C)                  # [H, R, C]
    assert np.isfinite(got).all()
    assert np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)) < 1e-3
    assert not got.reshape(H, 2, C, C)[..., np.triu_indices(C, 1)[0],
                                       np.triu_indices(C, 1)[1]].any()


def test_unsupported_reasons_and_dispatch(monkeypatch):
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    assert mosaic_unsupported_reason(q, q, q) is None
    assert "float32" in mosaic_unsupported_reason(q.astype(jnp.float32), q, q)
    odd = jnp.zeros((1, 64, 1, 96), jnp.bfloat16)
    assert "K=96" in mosaic_unsupported_reason(odd, odd, q)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        chunk_gla(q, q, q, q.astype(jnp.float32), impl="mosaic")
    monkeypatch.setattr(mdispatch, "on_hopper", lambda: True)
    assert mdispatch.mosaic_or("chunk_gla", "auto", q, lambda: None) == "auto"   # not proven
