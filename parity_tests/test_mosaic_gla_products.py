"""The GLA backward's per-chunk products kernel (fla_jax/ops/gla/mosaic_bwd_products.py) on a
CPU machine: interpreted (JAX's GPU interpret mode) against float64 and against the XLA
formulation it replaced (mosaic_bwd.PRODUCTS = "xla"). Kernel outputs cannot be poisoned
beforehand, so every element is compared, dA's padding columns included (they must be written
as zeros: the test fails when that store is dropped); lowering for CUDA at K, V in {64, 128,
256}; named errors."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fla_jax.ops.common.mosaic import export_for_cuda
from fla_jax.ops.common.mosaic.tiles import gpu_interpret
from fla_jax.ops.gla import mosaic_bwd
from fla_jax.ops.gla.mosaic_bwd_products import gla_bwd_products
from fla_jax.ops.gla.mosaic_intra_bwd_kernel import PAD

S = jax.ShapeDtypeStruct
DT = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
C = 64


def _inputs(R, H, K, V, dtype, seed=0):
    rng = np.random.default_rng(seed)
    dt = DT[dtype]
    do = jnp.asarray(rng.standard_normal((R, H, V)), dt)
    v = jnp.asarray(rng.standard_normal((R, H, V)), dt)
    hs = jnp.asarray(rng.standard_normal((R // C, H, V, K)), dt)
    dhs = jnp.asarray(rng.standard_normal((R // C, H, V, K)), dt)
    last = jnp.asarray(-rng.uniform(0.0, 8.0, (H, R // C, K)), jnp.float32)
    return do, v, hs, dhs, last


def _reference(do, v, hs, dhs, last, scale):
    """float64 dA [NC, H, C, C + PAD] (padding zero), dqg, dkg [NC, H, C, K], dstate [H, NC, K]."""
    do, v, hs, dhs, last = (np.asarray(x, np.float64) for x in (do, v, hs, dhs, last))
    R, H, V = do.shape
    NC = R // C
    dot = do.reshape(NC, C, H, V).transpose(0, 2, 1, 3)
    vt = v.reshape(NC, C, H, V).transpose(0, 2, 1, 3)
    da = np.zeros((NC, H, C, C + PAD))
    da[..., :C] = np.einsum("nhiv,nhjv->nhij", dot, vt) * scale
    dqg = np.einsum("nhcv,nhvk->nhck", dot, hs) * scale
    dkg = np.einsum("nhcv,nhvk->nhck", vt, dhs) * scale
    dst = np.einsum("nhvk,nhvk->hnk", hs, dhs) * scale * np.exp2(last)
    return da, dqg, dkg, dst


@pytest.mark.parametrize("K,V,dtype", [(128, 64, "bf16"), (64, 128, "fp16")])
def test_products_against_float64_and_xla(K, V, dtype):
    """Two chunks, two heads: every output within fp32 accumulation error of float64 (the
    products of 16-bit values are exact; a wrong part, head, chunk, transpose or a missing
    scale / gate factor is off by O(1)); the XLA formulation agrees to the same bound."""
    R, H, scale = 2 * C, 2, 0.37
    args = _inputs(R, H, K, V, dtype)
    with gpu_interpret():
        got = jax.jit(lambda *a: gla_bwd_products(*a, scale=scale))(*args)
    xla = jax.jit(lambda *a: mosaic_bwd._products_xla(*a, scale))(*args)
    want = _reference(*args, scale)
    for name, g, x, w in zip(("dA", "dqg", "dkg", "dstate"), got, xla, want):
        g, x = np.asarray(g, np.float64), np.asarray(x, np.float64)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert np.all(np.isfinite(g)), name
        tol = 1e-5 * (np.max(np.abs(w)) + 1.0)
        assert np.max(np.abs(g - w)) <= tol, (name, np.max(np.abs(g - w)), tol)
        assert np.max(np.abs(x - w)) <= tol, (name, "xla", np.max(np.abs(x - w)))
    assert np.all(np.asarray(got[0])[..., C:] == 0.0)     # dA's padding columns


@pytest.mark.parametrize("K,V,dtype", [(64, 64, "bf16"), (128, 128, "fp16"), (256, 64, "bf16"),
                                       (64, 256, "fp16")])
def test_products_kernel_lowers(K, V, dtype):
    R, H = 4 * C, 3
    dt = DT[dtype]
    text = export_for_cuda(lambda *a: gla_bwd_products(*a, scale=0.5),
                           S((R, H, V), dt), S((R, H, V), dt), S((R // C, H, V, K), dt),
                           S((R // C, H, V, K), dt), S((H, R // C, K), jnp.float32))
    assert "gla_bwd_products" in text and "mosaic_gpu" in text


def test_products_named_errors():
    do, v, hs, dhs, last = _inputs(2 * C, 1, 64, 64, "bf16")
    with pytest.raises(ValueError, match="gla_bwd_products: do_rows"):
        gla_bwd_products(do, v.astype(jnp.float16), hs, dhs, last, scale=1.0)
    with pytest.raises(ValueError, match="last"):
        gla_bwd_products(do, v, hs, dhs, last.astype(jnp.bfloat16), scale=1.0)
    with pytest.raises(ValueError, match="hs/dhs"):
        gla_bwd_products(do, v, hs[:1], dhs, last, scale=1.0)


def test_products_choice_is_checked(monkeypatch):
    monkeypatch.setattr(mosaic_bwd, "PRODUCTS", "einsum")
    from fla_jax.ops.gla import chunk_gla
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 64, 1, 64)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0, 1, (1, 64, 1, 64)), jnp.float32)

    def loss(q):
        return chunk_gla(q, q, q, g, impl="mosaic")[0].astype(jnp.float32).sum()
    with pytest.raises(ValueError, match="PRODUCTS='einsum'"):
        with gpu_interpret():
            jax.grad(loss)(q)
