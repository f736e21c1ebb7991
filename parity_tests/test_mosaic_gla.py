"""chunk_gla impl='mosaic' (Pallas Mosaic GPU forward and backward) on a CPU machine.

- Lowering: the forward and backward kernels lower for CUDA with jax.export (layouts, wgmma
  shapes, TMA, SMEM size) for K, V in {64, 128, 256}, bf16 / fp16, h0, varlen.
- Numerics: JAX's GPU interpret mode runs the kernels against the harness's float64 oracle
  (cases.MOSAIC_KERNEL_CASES mos_gla_*: varlen with an empty sequence, gates in [-20, -10],
  mild gates whose parts are bounded), with either backward; the chunk-parallel kernel
  (cumsum, factors, intra-chunk scores) against float64 directly, strong gates and bounded
  parts (mosaic_intra_kernel.FAST) included.
- Dispatch: GPU-proven (RESULTS.md runs 17, 18), so impl='auto' takes it on Hopper for bf16 /
  fp16 calls it fits; named errors.
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
from fla_jax.ops.gla import chunk_gla, mosaic_unsupported_reason
from fla_jax.ops.gla import mosaic_intra_kernel
from fla_jax.ops.gla.mosaic_intra_kernel import gla_intra

from .harness import assert_passed, check

S = jax.ShapeDtypeStruct
DT = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def _lower(K, V, dtype, varlen, backward=False, T=300, H=2):
    """chunk_gla(impl='mosaic') lowered for CUDA; backward: with the gradients of every input
    (h0 included) for cotangents of o and the final state."""
    B, N = (1, 3) if varlen else (2, 2)
    dt = DT[dtype]
    args = [S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, H, V), dt),
            S((B, T, H, K), jnp.float32), S((N, H, K, V), jnp.float32)]
    args += [S((N + 1,), jnp.int32)] if varlen else []

    def f(q, k, v, g, h0, cu=None):
        return chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         impl="mosaic")

    def fb(q, k, v, g, h0, cu=None):
        (o, ht), vjp = jax.vjp(lambda *x: f(*x, cu), q, k, v, g, h0)
        return vjp((jnp.ones_like(o), jnp.ones_like(ht)))
    return export_for_cuda(fb if backward else f, *args)


@pytest.mark.parametrize("K,V,dtype,varlen", [(64, 64, "bf16", True), (128, 128, "fp16", False),
                                              (256, 64, "bf16", True), (64, 256, "fp16", False)])
def test_forward_lowers(K, V, dtype, varlen):
    text = _lower(K, V, dtype, varlen)
    assert "gla_fwd" in text and "gla_intra" in text and "mosaic_gpu" in text


@pytest.mark.parametrize("case,dtype", [("mos_gla_varlen", "bf16"), ("mos_gla_strong", "fp16")])
def test_interpreted_against_float64(case, dtype, monkeypatch):
    """The Mosaic forward with BACKWARD = "pallas" (the Pallas forward and backward under
    differentiation) against the float64 oracle."""
    from fla_jax.ops.gla import mosaic_chunk
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "pallas")
    with gpu_interpret():
        assert_passed(check("chunk_gla", case, dtype, {"jax": "mosaic"}))


@pytest.mark.parametrize("case,dtype", [("mos_gla_varlen", "bf16"), ("mos_gla_strong", "fp16")])
def test_mosaic_backward_interpreted_against_float64(case, dtype, monkeypatch):
    """The Mosaic backward (the default; mosaic_bwd.py: states and the reverse pass on the forward
    kernel, the intra-chunk gradient kernel) against the float64 oracle: every gradient, varlen
    with an empty sequence and h0, gates to -20 per token."""
    from fla_jax.ops.gla import mosaic_chunk
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    with gpu_interpret():
        assert_passed(check("chunk_gla", case, dtype, {"jax": "mosaic"}))


def test_bounded_parts_forward_and_backward(monkeypatch):
    """Mild gates in fp16 (mos_gla_mild): with mosaic_intra_kernel.FAST the forward's and the
    Mosaic backward's diagonal blocks run on the tensor cores; o and every gradient pass
    against float64 either way, and the two runs differ (the bounded path ran)."""
    from fla_jax.ops.gla import mosaic_chunk
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(mosaic_intra_kernel, "FAST", fast)
        jax.clear_caches()
        out = {}
        with gpu_interpret():
            assert_passed(check("chunk_gla", "mos_gla_mild", "fp16", {"jax": "mosaic"},
                                outputs=out))
        runs.append(out["jax"])
    for name in ("o", "dq", "dk", "dg"):
        a, b = (np.asarray(r[name], np.float32) for r in runs)
        assert not np.array_equal(a, b), name


def _intra_reference(q, k, g, C):
    """float64 qg, kg [R, H, K], A [H, R, C], last [H, NC, K] (mosaic_intra_kernel's outputs)."""
    R, H, K = q.shape
    q, k = q.reshape(R // C, C, H, K), k.reshape(R // C, C, H, K)
    b = np.cumsum(g.reshape(R // C, C, H, K), 1) / np.log(2.0)
    last = b[:, -1]
    expo = b[:, :, None] - b[:, None, :]                                   # [n, i, j, H, K]
    causal = np.tril(np.ones((C, C), bool))[None, :, :, None, None]
    a = np.sum(q[:, :, None] * k[:, None] * np.exp2(np.where(causal, expo, -np.inf)), -1)
    return ((q * np.exp2(b)).reshape(R, H, K), (k * np.exp2(last[:, None] - b)).reshape(R, H, K),
            a.transpose(3, 0, 1, 2).reshape(H, R, C), last.transpose(1, 0, 2))


@pytest.mark.parametrize("K,dtype,strong", [(64, "fp16", True), (128, "bf16", False)])
def test_intra_kernel_against_float64(K, dtype, strong):
    """The chunk-parallel kernel (cumsum, qg, kg, last, scores A) interpreted against float64:
    with gates to -20 per token and channel (strong) no overflow and the scores within fp16
    rounding; zeros above the diagonal; two chunks, two heads."""
    rng = np.random.default_rng(3)
    C, H, R = 64, 2, 128
    q = jnp.asarray(rng.standard_normal((R, H, K)), DT[dtype])
    k = jnp.asarray(rng.standard_normal((R, H, K)), DT[dtype])
    if strong:
        g = -rng.uniform(0.0, 20.0, (R, H, K)) * (rng.uniform(size=(1, 1, K)) < 0.3)
    else:
        g = np.log(rng.uniform(0.8, 1.0, (R, H, K)))
    g = jnp.asarray(g, jnp.float32)
    with gpu_interpret():
        got = jax.jit(gla_intra)(q, k, g)
    want = _intra_reference(*(np.asarray(x, np.float64) for x in (q, k, g)), C)
    bound = {"fp16": 1e-3, "bf16": 8e-3}[dtype]
    for name, o, r in zip(("qg", "kg", "A", "last"), got, want):
        o = np.asarray(o.astype(jnp.float32), np.float64)
        assert np.isfinite(o).all(), name
        rel = np.sqrt(np.mean((o - r) ** 2) / np.mean(r ** 2))
        assert rel < (1e-6 if name == "last" else bound), (name, rel)
    a = np.asarray(got[2].astype(jnp.float32)).reshape(H, R // C, C, C)
    assert not a[..., np.triu_indices(C, 1)[0], np.triu_indices(C, 1)[1]].any()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_intra_kernel_bounded_parts(dtype, monkeypatch):
    """Bounded parts (mosaic_intra_kernel.FAST): key columns 0..31 with mild gates form their
    diagonal blocks on the tensor cores, columns 32..63 (gates to -20) stay exact. A differs
    from the exact-only kernel (the bounded path ran) and both are within 16-bit rounding of
    float64; under strong gates alone the two kernels agree bit for bit."""
    rng = np.random.default_rng(7)
    C, H, R, K = 64, 1, 128, 64
    q = jnp.asarray(rng.standard_normal((R, H, K)), DT[dtype])
    k = jnp.asarray(rng.standard_normal((R, H, K)), DT[dtype])
    mild = np.log(rng.uniform(0.8, 1.0, (R, H, K)))
    strong = -rng.uniform(0.0, 20.0, (R, H, K))
    bound = {"fp16": 1e-3, "bf16": 8e-3}[dtype]
    for g, differs in ((np.concatenate([mild[..., :32], strong[..., 32:]], -1), True),
                       (strong, False)):
        g = jnp.asarray(g, jnp.float32)
        outs = []
        for fast in (True, False):
            monkeypatch.setattr(mosaic_intra_kernel, "FAST", fast)
            with gpu_interpret():
                outs.append([np.asarray(x.astype(jnp.float32), np.float64)      # (a fresh
                             for x in jax.jit(lambda *a: gla_intra(*a))(q, k, g)])   # trace)
        want = _intra_reference(*(np.asarray(x, np.float64) for x in (q, k, g)), C)
        for got in outs:
            rel = np.sqrt(np.mean((got[2] - want[2]) ** 2) / np.mean(want[2] ** 2))
            assert np.isfinite(got[2]).all() and rel < bound, (dtype, rel)
        for i in (0, 1, 3):                     # qg, kg, last: the same path either way
            assert np.array_equal(outs[0][i], outs[1][i])
        assert np.array_equal(outs[0][2], outs[1][2]) != differs


def test_intra_kernel_chunks_per_cta_bit_identical(monkeypatch):
    """Several chunks per CTA (the next chunk's loads in flight across the boundary; 5 chunks
    over CTAs of 2 and 3: a partial last CTA) compute exactly what one chunk per CTA does."""
    rng = np.random.default_rng(5)
    R, H, K = 320, 1, 64
    q = jnp.asarray(rng.standard_normal((R, H, K)), jnp.float16)
    k = jnp.asarray(rng.standard_normal((R, H, K)), jnp.float16)
    g = jnp.asarray(-rng.uniform(0.0, 3.0, (R, H, K)), jnp.float32)
    outs = []
    for cpc in (1, 2, 3):
        monkeypatch.setattr(mosaic_intra_kernel, "CHUNKS_PER_CTA", cpc)
        with gpu_interpret():
            # a fresh function per setting: jit's trace cache would reuse the first trace
            outs.append([np.asarray(x) for x in jax.jit(lambda *a: gla_intra(*a))(q, k, g)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert np.isfinite(a).all() and np.array_equal(a, b)


def test_exact_only_kernels_lower(monkeypatch):
    """With mosaic_intra_kernel.FAST off (the exact diagonal blocks in every part) the forward
    and backward kernels lower too (a NumPy bool constant in their masks did not: H100 run 18
    call 5)."""
    from fla_jax.ops.gla import mosaic_chunk
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    monkeypatch.setattr(mosaic_intra_kernel, "FAST", False)
    text = _lower(128, 64, "fp16", True, backward=True)
    assert "gla_intra_bwd" in text and "gla_intra" in text


def test_backward_kernels_lower(monkeypatch):
    """The Mosaic backward's kernels (the forward kernel in states and reverse modes, the
    intra-chunk gradient kernel) lower for CUDA."""
    from fla_jax.ops.gla import mosaic_chunk
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    text = _lower(128, 64, "bf16", True, backward=True)
    assert "gla_intra_bwd" in text and "gla_fwd" in text


def test_intra_kernel_lowers(monkeypatch):
    for K, dt in ((64, jnp.bfloat16), (256, jnp.float16)):
        text = export_for_cuda(gla_intra, S((256, 2, K), dt), S((256, 2, K), dt),
                               S((256, 2, K), jnp.float32))
        assert "gla_intra" in text
    monkeypatch.setattr(mosaic_intra_kernel, "CHUNKS_PER_CTA", 4)
    assert "gla_intra" in export_for_cuda(gla_intra, S((320, 1, 64), jnp.bfloat16),
                                          S((320, 1, 64), jnp.bfloat16),
                                          S((320, 1, 64), jnp.float32))


def test_intra_kernel_builds_with_lane_semantics(monkeypatch):
    """The intra kernel reads row-shifted windows of plain SMEM buffers: built with Warpgroup
    semantics (jax 0.11's default) those buffers get an inferred swizzle and the windows read
    permuted columns on the GPU (RESULTS.md run 17), silently. It must ask for Lane semantics
    (jax 0.10's default, so the request itself is what is checked), and tiles turns that into
    the compiler parameter."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from fla_jax.ops.common.mosaic import tiles
    seen = []

    def spy(*a, **kw):
        seen.append(kw.get("lane"))
        return tiles.build(*a, **kw)
    monkeypatch.setattr(mosaic_intra_kernel, "build", spy)
    x = S((256, 1, 64), jnp.bfloat16)
    export_for_cuda(gla_intra, x, x, S((256, 1, 64), jnp.float32))
    assert seen == [True]
    assert tiles.compiler_params(lane=True).lowering_semantics == plgpu.LoweringSemantics.Lane


def test_unsupported_reasons_and_dispatch(monkeypatch):
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    assert mosaic_unsupported_reason(q, q, q) is None
    assert "float32" in mosaic_unsupported_reason(q.astype(jnp.float32), q, q)
    odd = jnp.zeros((1, 64, 1, 96), jnp.bfloat16)
    assert "K=96" in mosaic_unsupported_reason(odd, odd, q)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        chunk_gla(q, q, q, q.astype(jnp.float32), impl="mosaic")
    monkeypatch.setattr(mdispatch, "on_hopper", lambda: True)
    # GPU-proven (AUTO_MOSAIC): 'auto' takes it on Hopper for bf16 / fp16 when it fits
    assert mdispatch.mosaic_or("chunk_gla", "auto", q, lambda: None) == "mosaic"
    assert mdispatch.mosaic_or("chunk_gla", "auto", q, lambda: "K=96") == "auto"
    assert mdispatch.mosaic_or("chunk_gla", "auto", q.astype(jnp.float32), lambda: None) == "auto"
    # 'auto' takes the Mosaic kernels only at GPU-proven head sizes (AUTO_HEADS)
    from fla_jax.ops.gla import mosaic_chunk
    big = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
    assert mosaic_chunk.auto_unsupported_reason(big, big) is None
    assert mosaic_chunk.auto_unsupported_reason(q, jnp.zeros((1, 64, 1, 256), jnp.bfloat16)) is None
    assert "K=64, V=64" in mosaic_chunk.auto_unsupported_reason(q, q)
    assert "K=128, V=256" in mosaic_chunk.auto_unsupported_reason(
        big, jnp.zeros((1, 64, 1, 256), jnp.bfloat16))
    seen = []
    monkeypatch.setattr(mdispatch, "mosaic_or",
                        lambda op, impl, q_, reason: seen.append(reason()) or "reference")
    from fla_jax.ops.gla import interface
    monkeypatch.setattr(interface, "mosaic_or", mdispatch.mosaic_or)
    g32 = jnp.zeros((1, 64, 1, 64), jnp.float32)
    chunk_gla(q, q, q, g32)                                 # K = V = 64: not for 'auto'
    chunk_gla(big, big, big, jnp.zeros((1, 64, 1, 128), jnp.float32))
    assert "K=64" in seen[0] and seen[1] is None


@pytest.mark.parametrize("case,dtype", [("mos_gla_varlen", "bf16")])
def test_split_forward_interpreted_against_float64(case, dtype, monkeypatch):
    """mosaic_split.SPLIT (the default): the forward over sequence pieces (a state pass from zero,
    the per-key piece decays, the scan, the output pass from the starts) and the Mosaic
    backward's reverse pass over pieces (from a zero end gradient, the backward scan, the pass
    from the ends); 4 pieces a sequence of 0-2 chunks here: empty pieces, an empty sequence,
    h0; against the float64 oracle."""
    from fla_jax.ops.gated_delta_rule import mosaic_pieces
    from fla_jax.ops.gla import mosaic_chunk, mosaic_split
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    monkeypatch.setattr(mosaic_split, "SPLIT", True)
    monkeypatch.setattr(mosaic_pieces, "MIN_PIECE_CHUNKS", 0)
    monkeypatch.setattr(mosaic_pieces, "MAX_PIECES", 4)
    assert mosaic_split.pieces(4, 1, 128, 0) == 4
    with gpu_interpret():
        assert_passed(check("chunk_gla", case, dtype, {"jax": "mosaic"}))


def test_split_policy_and_lowering(monkeypatch):
    """The split's policy (on by default, off with SPLIT False; B1 T32768 H16 V128: 4 pieces; 128
    CTAs: none), the
    piece decays against a float64 loop, and the split forward + Mosaic backward lower (two
    forward kernels in each direction)."""
    from fla_jax.ops.gated_delta_rule import mosaic_pieces
    from fla_jax.ops.gla import mosaic_chunk, mosaic_split
    assert mosaic_split.SPLIT and mosaic_split.pieces(1, 16, 128, 512) == 4
    monkeypatch.setattr(mosaic_split, "SPLIT", False)
    assert mosaic_split.pieces(1, 16, 128, 512) == 1
    monkeypatch.setattr(mosaic_split, "SPLIT", True)
    assert mosaic_split.pieces(4, 16, 128, 64) == 1
    table = jnp.zeros((2, 32), jnp.int32).at[:, 0].set(jnp.array([0, 5])).at[:, 1].set(
        jnp.array([5, 2]))
    ptab = mosaic_pieces.piece_table(table, 4)
    last = np.random.default_rng(0).uniform(-3, 0, (2, 8, 4))
    got = np.asarray(mosaic_split.piece_decay(jnp.asarray(last, jnp.float32), ptab))
    want = np.zeros((8, 2, 4))
    for r, (f, n) in enumerate(np.asarray(ptab[:, :2])):
        want[r] = last[:, f:f + n].sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = [S((1, 4096, 2, 128), bf)] * 3 + [S((1, 4096, 2, 128), jnp.float32),
                                             S((1, 2, 128, 128), jnp.float32)]

    def fb(q, k, v, g, h0):
        def f(*a):
            return chunk_gla(*a[:3], g=a[3], initial_state=a[4], output_final_state=True,
                             impl="mosaic")
        (o, ht), vjp = jax.vjp(f, q, k, v, g, h0)
        return vjp((jnp.ones_like(o), jnp.ones_like(ht)))
    text = export_for_cuda(fb, *args)
    # the forward's two passes and the backward's two reverse passes (4 pieces each)
    assert text.count("gla_fwd_mosaic_gpu") == 4, text.count("gla_fwd_mosaic_gpu")
