"""chunk_simple_gla impl='mosaic' (Pallas Mosaic GPU kernels) on a CPU machine.

- Lowering: every kernel (forward, and the backward through the vjp) lowers for CUDA with
  jax.export (the Mosaic GPU lowering checks layouts, wgmma shapes, barriers, TMA and SMEM
  size) for K = V in {64, 128, 256}, bf16/fp16, h0, varlen.
- Numerics: JAX's GPU interpret mode (tiles.gpu_interpret: simulated SMEM, TMA, barriers)
  runs the kernels against the harness's float64 oracle (cases.MOSAIC_KERNEL_CASES; it checks the
  data flow: indices, packing, pipelining, masking; not the register layouts of a real GPU).
- Dispatch: what impl='mosaic' raises off a Hopper GPU, what impl='auto' picks.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import pytest

from fla_jax.ops.common.mosaic import dispatch as mdispatch
from fla_jax.ops.common.mosaic import export_for_cuda
from fla_jax.ops.common.mosaic.tiles import gpu_interpret
from fla_jax.ops.simple_gla import (chunk_simple_gla, mosaic_chunk, mosaic_fwd, mosaic_split,
                                    mosaic_unsupported_reason)

from .harness import assert_passed, check

S = jax.ShapeDtypeStruct
DT = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def _lower(K, dtype, varlen, backward, T=300, H=2):
    B, N = (1, 3) if varlen else (2, 2)
    dt = DT[dtype]
    args = [S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, H, K), dt),
            S((B, T, H), jnp.float32), S((N, H, K, K), jnp.float32)]
    args += [S((N + 1,), jnp.int32)] if varlen else []

    def f(q, k, v, g, h0, cu=None):
        return chunk_simple_gla(q, k, v, g=g, initial_state=h0, output_final_state=True,
                                cu_seqlens=cu, impl="mosaic")

    fn = f
    if backward:
        def fn(*a):
            (o, ht), vjp = jax.vjp(f, *a)    # one forward, not a second one for the shapes
            return vjp((jnp.ones_like(o), jnp.ones_like(ht)))
    return export_for_cuda(fn, *args)


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_lowers(K, dtype):
    text = _lower(K, dtype, varlen=False, backward=False)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("K", [64, 128])
def test_warp_specialized_forward_lowers(K, monkeypatch):
    """TUNING["ws"] (the default) takes K <= 128; off, the one-warpgroup kernel."""
    assert mosaic_fwd.TUNING["ws"]
    text = _lower(K, "fp16", varlen=True, backward=False)
    assert "simple_gla_mosaic_fwd_ws" in text
    monkeypatch.setitem(mosaic_fwd.TUNING, "ws", False)
    text = _lower(K, "fp16", varlen=True, backward=False)
    assert "simple_gla_mosaic_fwd_ws" not in text and "simple_gla_mosaic_fwd" in text


def test_training_forward_stores_the_states(monkeypatch):
    """RESIDUAL_STATES (the default): the training forward's ws kernel stores the chunk states
    and the backward runs no states pass; off, the backward recomputes them with the
    one-warpgroup kernel (one more of those in the vjp; the split's 'final' passes are that
    kernel too). Fixed length and the sequence split (B2 H2 T4096)."""
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    assert mosaic_chunk.RESIDUAL_STATES and mosaic_split.pieces(2, 2, 128, 64, False) > 1
    one_wg = "simple_gla_mosaic_fwd_mosaic_gpu"
    for T, finals in ((300, 0), (64 * 64, 1)):
        counts = {}
        for residual in (True, False):
            monkeypatch.setattr(mosaic_chunk, "RESIDUAL_STATES", residual)
            text = _lower(128, "bf16", varlen=False, backward=True, T=T)
            counts[residual] = text.count(one_wg)
            # the ws forward's states are read by the backward (else XLA drops the forward)
            assert ("simple_gla_mosaic_fwd_ws_mosaic_gpu" in text) == residual, T
        assert counts == {True: finals, False: finals + 1}, (T, counts)


@pytest.mark.parametrize("K", [64, 128, 256])
def test_varlen_vjp_lowers(K):
    """The vjp with each backward (Mosaic kernels for K <= 128, else the Pallas ones)."""
    for backward in mosaic_chunk.BACKWARDS:
        old = mosaic_chunk.BACKWARD
        mosaic_chunk.BACKWARD = backward
        try:
            text = _lower(K, "bf16", varlen=True, backward=True)
        finally:
            mosaic_chunk.BACKWARD = old
        mosaic = backward == "mosaic" and K <= 128
        assert text.count("mosaic_gpu") >= (3 if mosaic else 0), backward
        assert ("xla.gpu.triton" in text) == (not mosaic), backward


# case -> forward settings: "ws" the warp-specialized forward (the default; its training
# forward stores the chunk states the backward reads), "one" the one-warpgroup forward (the
# backward recomputes the states), "split" the ws forward over pieces of 2, 2, 1 and 0 chunks
# per sequence (the split's scans, an empty piece, the stored states in the flat layout: the
# ws kernel's sequence-table path)
CASES = {"mos_sgla_g_h0_t150": "ws", "mos_sgla_gamma_varlen": "one", "mos_sgla_split": "split",
         "mos_sgla_strong": "one"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted_against_float64(case, monkeypatch):
    """Mosaic forward and backward kernels in the GPU interpreter vs float64 (bf16; the strong
    gates also in fp16)."""
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    monkeypatch.setitem(mosaic_fwd.TUNING, "ws", CASES[case] != "one")
    if CASES[case] == "split":
        monkeypatch.setitem(mosaic_split.POLICY, "min_piece_chunks", 1)
        assert mosaic_split.pieces(1, 1, 64, 5, False) == 4
    with gpu_interpret():
        for dtype in ("bf16", "fp16") if case == "mos_sgla_strong" else ("bf16",):
            assert_passed(check("chunk_simple_gla", case, dtype, {"jax": "mosaic"}))


@pytest.mark.parametrize("step,overlap", [("kd", False), ("kd", True), ("vt", False),
                                           ("vt", True)])
def test_ws_variants_interpreted_and_lower(step, overlap, monkeypatch):
    """mosaic_fwd_ws's choices (STATE_STEP "vt": decayed v^T in registers as the update's left
    operand, "kd": decayed keys through SMEM; OVERLAP: the output warpgroup's masks formed during
    q k^T, q S and P v issued together), set alike for the inference and the training forward:
    interpreted vs float64 (h0, a partial last chunk; forward and gradients) and lowered."""
    from fla_jax.ops.simple_gla import mosaic_fwd_ws
    assert mosaic_fwd_ws.choices(False)[1] and not mosaic_fwd_ws.choices(True)[1]
    for name, value in (("STATE_STEP", step), ("TRAIN_STATE_STEP", step), ("OVERLAP", overlap),
                        ("TRAIN_OVERLAP", overlap)):
        monkeypatch.setattr(mosaic_fwd_ws, name, value)
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    assert mosaic_fwd.TUNING["ws"]
    with gpu_interpret():
        assert mosaic_fwd_ws.choices(False) == (step == "vt", overlap)
        assert_passed(check("chunk_simple_gla", "mos_sgla_g_h0_t150", "bf16", {"jax": "mosaic"}))
    assert "simple_gla_mosaic_fwd_ws" in _lower(128, "fp16", varlen=True, backward=False)


def test_mosaic_needs_hopper():
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        chunk_simple_gla(q, q, q, impl="mosaic")


def test_unsupported_reasons():
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    assert mosaic_unsupported_reason(q, q, q) is None
    assert "float32" in mosaic_unsupported_reason(q.astype(jnp.float32), q, q)
    odd = jnp.zeros((1, 64, 1, 96), jnp.bfloat16)
    assert "K=96" in mosaic_unsupported_reason(odd, odd, q)
    big = jnp.zeros((1, 64, 1, 512), jnp.bfloat16)
    assert "V=512" in mosaic_unsupported_reason(q, q, big)


def test_auto_picks(monkeypatch):
    """'auto' takes mosaic only on Hopper, for a GPU-proven op/dtype, when the call fits."""
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    ok = lambda: None  # noqa: E731
    assert mdispatch.mosaic_or("chunk_simple_gla", "auto", q, ok) == "auto"   # CPU
    monkeypatch.setattr(mdispatch, "on_hopper", lambda: True)
    assert mdispatch.mosaic_or("chunk_simple_gla", "auto", q, ok) == "mosaic"  # GPU-proven
    monkeypatch.setattr(mdispatch, "AUTO_MOSAIC", {})
    assert mdispatch.mosaic_or("chunk_simple_gla", "auto", q, ok) == "auto"   # not proven
    monkeypatch.setattr(mdispatch, "AUTO_MOSAIC", {"chunk_simple_gla": ("bf16",)})
    assert mdispatch.mosaic_or("chunk_simple_gla", "auto", q, ok) == "mosaic"
    assert mdispatch.mosaic_or("chunk_simple_gla", "auto", q, lambda: "K=96") == "auto"
    assert mdispatch.mosaic_or("chunk_simple_gla", "auto", q.astype(jnp.float16), ok) == "auto"
    assert mdispatch.mosaic_or("chunk_simple_gla", "pallas", q, ok) == "pallas"
    # on CPU impl='auto' still runs (chunked path), it never reaches the Mosaic kernels
    monkeypatch.setattr(mdispatch, "on_hopper", lambda: False)
    o, _ = chunk_simple_gla(q, q, q, impl="auto")
    assert o.shape == q.shape


def test_mosaic_named_errors_on_hopper(monkeypatch):
    """On a (pretended) Hopper GPU impl='mosaic' refuses what its kernels cannot take, naming
    why and pointing at impl='pallas'."""
    from fla_jax.ops.common.mosaic import lowering
    monkeypatch.setattr(lowering, "on_hopper", lambda: True)
    q32 = jnp.zeros((1, 64, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="float32.*impl='pallas'"):
        chunk_simple_gla(q32, q32, q32, impl="mosaic")
    q = jnp.zeros((1, 64, 1, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="K=96"):
        chunk_simple_gla(q, q, q, impl="mosaic")


def test_interpreter_compile_once_is_exact(monkeypatch):
    """parity_tests/mosaic_interpret_patch.py (CPU runs: each warpgroup jaxpr compiled once,
    not per CTA): the warp-specialized forward (three warpgroups, 2 x 2 CTAs) gives the same
    o and final state, bit for bit, as with the interpreter's own per-CTA compile, and
    compiled fewer times."""
    import numpy as np
    from jax._src.pallas.mosaic.interpret import thread_map

    from parity_tests import mosaic_interpret_patch
    if os.environ.get("PARITY_DEVICE", "cpu") == "cuda":
        pytest.skip("the compile-once patch is applied only where the Mosaic kernels are "
                    "interpreted (CPU runs); a GPU run compiles them for the device")
    assert mosaic_interpret_patch.apply() and mosaic_interpret_patch.apply()
    patched = thread_map._run_jaxpr
    assert patched.__wrapped__ is not None
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 128, 2, 64)) / 8, jnp.bfloat16)
               for _ in range(3))
    g = jnp.asarray(-rng.uniform(0.0, 0.5, (2, 128, 2)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((2, 2, 64, 64)), jnp.float32)
    assert mosaic_fwd.TUNING["ws"]
    outs, compiles = [], []
    real = jax.stages.Lowered.compile
    for run in (patched, patched.__wrapped__):
        monkeypatch.setattr(thread_map, "_run_jaxpr", run)
        count = []
        monkeypatch.setattr(jax.stages.Lowered, "compile",
                            lambda self, *a, real=real, count=count, **kw:
                            count.append(1) or real(self, *a, **kw))
        with gpu_interpret():
            # a fresh function each time: jit's trace cache would reuse the first trace
            o, ht = jax.jit(lambda *a: chunk_simple_gla(*a[:3], g=a[3], initial_state=a[4],
                                                        output_final_state=True,
                                                        impl="mosaic"))(q, k, v, g, h0)
        outs.append((np.asarray(o, np.float32), np.asarray(ht)))
        compiles.append(len(count))
    assert compiles[0] < compiles[1], compiles
    for a, b in zip(*outs):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)
