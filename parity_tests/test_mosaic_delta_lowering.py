"""chunk_gated_delta_rule / chunk_delta_rule impl='mosaic' (Pallas Mosaic GPU kernels) on a
CPU machine.

- Lowering: the forward kernel (and the vjp with either backward: mosaic_chunk.BACKWARD
  "mosaic", the default, or "pallas", the Pallas Triton-lowering kernels) lowers for CUDA with
  jax.export for K = V in {64, 128, 256}, bf16/fp16, h0, varlen, GQA.
- Numerics: JAX's GPU interpret mode (common/mosaic/tiles.gpu_interpret) runs the kernels
  against the harness's float64 oracle (cases.MOSAIC_KERNEL_CASES, every output and
  gradient): indices, packing, pipelining and masking; not the register layouts of a real GPU.
- Dispatch: what impl='mosaic' raises off a Hopper GPU; the unsupported reasons.
- The gate-free inverse T0 as a Mosaic kernel (mosaic_kkt.py): against float64 per chunk
  (keys nearly parallel with beta up to 1.95 included), one and several chunks per CTA, and
  the whole op with it, interpreted; it lowers for CUDA.
- The forward: the warp-specialized kernel (mosaic_fwd_ws.py, FORWARD="ws", also storing the
  backward's residuals) in the interpreted cases, the one-warpgroup kernel fed by -W' / U^T
  (FORWARD="wy") in one case; which one each call takes.
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
from fla_jax.ops.gated_delta_rule import (chunk_gated_delta_rule, mosaic_bwd, mosaic_chunk,
                                           mosaic_unsupported_reason)
from fla_jax.ops.gated_delta_rule import mosaic_bwd_grads, mosaic_kkt
from fla_jax.ops.gated_delta_rule.mosaic_kkt import C, gate_free_inverse_mosaic

from .harness import assert_passed, check

S = jax.ShapeDtypeStruct
DT = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def _lower(K, dtype, varlen, backward, gated=True, T=300, H=2, HV=4, V=None):
    B, N = (1, 3) if varlen else (2, 2)
    dt, V = DT[dtype], V or K
    args = [S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, HV, V), dt),
            S((B, T, HV), jnp.float32), S((B, T, HV), jnp.float32),
            S((N, HV, K, V), jnp.float32)]
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


def pallas_chunk_calls(text: str) -> int:
    """Triton-lowered kernel calls in a lowered module other than the gate-rows kernel of the
    Mosaic path (mosaic_gates.py): the Pallas chunk kernels."""
    calls = text.split("custom_call @")[1:]
    return sum(1 for c in calls if c.startswith("__gpu$xla.gpu.triton")
               and "gdn_gate_rows" not in c)


def test_gate_rows_kernel_in_the_mosaic_programs(mosaic_backward):
    """The Mosaic forward and backward each form their gate vectors with the gate-rows kernel,
    and no other Triton-lowered kernel is in them."""
    text = _lower(128, "bf16", varlen=False, backward=True)
    calls = text.split("custom_call @")[1:]
    gates = [c for c in calls if c.startswith("__gpu$xla.gpu.triton") and "gdn_gate_rows" in c]
    assert len(gates) == 2 and pallas_chunk_calls(text) == 0


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_lowers(K, dtype):
    assert "mosaic_gpu" in _lower(K, dtype, varlen=False, backward=False)


@pytest.mark.parametrize("K,V", [(64, 256), (256, 64), (64, 128)])
def test_forward_lowers_k_not_v(K, V, monkeypatch):
    """K != V, forward and the Mosaic backward (the H100 parity run's gpu_k256_v64 case failed
    to lower under jax 0.11.2 from a constant buffer slot; jax 0.10.2 lowered it)."""
    assert "mosaic_gpu" in _lower(K, "bf16", varlen=True, backward=False, V=V)
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    text = _lower(K, "bf16", varlen=True, backward=True, V=V)
    if max(K, V) <= mosaic_bwd.MAX_HEAD:
        assert "mosaic_gpu" in text and pallas_chunk_calls(text) == 0
    else:   # the Mosaic backward's tiles do not fit shared memory: the Pallas one runs
        assert "triton" in text and "mosaic_gpu" not in text


@pytest.fixture
def mosaic_backward(monkeypatch):
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")


@pytest.mark.parametrize("gated", [True, False])
def test_varlen_vjp_lowers(gated, monkeypatch):
    """With the Pallas backward a differentiated call runs the Pallas forward (its residuals
    feed that backward; a Mosaic forward would be computed for o alone): the vjp program holds
    Triton-lowered kernels only, the plain forward the Mosaic ones."""
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "pallas")
    text = _lower(128, "bf16", varlen=True, backward=True, gated=gated)
    assert "triton" in text and "mosaic_gpu" not in text
    assert "mosaic_gpu" in _lower(128, "bf16", varlen=True, backward=False, gated=gated)


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mosaic_backward_lowers(K, dtype, mosaic_backward):
    text = _lower(K, dtype, varlen=K == 64, backward=True)
    assert "mosaic_gpu" in text and pallas_chunk_calls(text) == 0
    assert "gdn_bwd_grads" in text and "gdn_bwd_states" in text


def test_mosaic_backward_large_heads_take_pallas(mosaic_backward):
    """K = 256: the per-chunk gradient kernel's tiles do not fit shared memory, so the vjp
    runs the Pallas forward and backward (mosaic_chunk._gdn_fwd)."""
    text = _lower(256, "bf16", varlen=False, backward=True)
    assert "triton" in text and "mosaic_gpu" not in text


@pytest.mark.parametrize("op,case,backward,dtype", [
    ("chunk_gated_delta_rule", "mos_dr_gqa_h0_t100", "pallas", "bf16"),
    # (GDN varlen runs in fp16 below only: its bf16 twin cost 57 s of CI for the same kernels)
    ("chunk_delta_rule", "mos_dr_gqa_h0_t100", "mosaic", "bf16"),
    # fp16's tolerances are 5x tighter: the Mosaic backward kernels' numerics
    ("chunk_gated_delta_rule", "mos_dr_gqa_h0_t100", "mosaic", "fp16"),
    ("chunk_gated_delta_rule", "mos_dr_varlen", "mosaic", "fp16"),
    # gates in [-20, -10] per token: a gate factor on a 16-bit operand flushes to zero in fp16
    # (the H100 run's dh0 of gpu_strong_*: 2e-2 and 1e-1 before the factor moved to fp32)
    ("chunk_gated_delta_rule", "mos_dr_strong", "mosaic", "fp16")])
def test_interpreted_against_float64(op, case, backward, dtype, monkeypatch):
    from fla_jax.ops.gated_delta_rule import mosaic_fwd_ws
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", backward)
    if case != "mos_dr_strong":     # CI time: the ws forward's third input stage (the default
        monkeypatch.setattr(mosaic_fwd_ws, "MAX_STAGES", 2)    # plan) interpreted once
    with gpu_interpret():
        assert_passed(check(op, case, dtype, {"jax": "mosaic"}))


def _small_forward(seed: int):
    """The delta family's Mosaic forward (o, final state), interpreted, on random inputs: two
    chunks, GQA (2 value heads on 1 key head), K = V = 64, bf16, h0."""
    rng = np.random.default_rng(seed)
    B, T, H, HV, K, V = 1, 2 * C, 1, 2, 64, 64
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, K)) / 8, jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, HV, V)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0, 0.3, (B, T, HV)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (B, T, HV)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((B, HV, K, V)), jnp.float32)
    with gpu_interpret():
        return mosaic_chunk.forward(q, k, v, g, beta, h0, None, scale=0.125, l2=False)


def test_ws_forward_v_transposed_by_load(monkeypatch):
    """mosaic_fwd_ws.IDENTITY_V_T: v^T by a transposed register load (False, the default;
    lowers under jax >= 0.11, which the GPU runs, and in the interpreter; checked against
    float64 by the interpreted cases above) or by a product with the identity (True, and
    under older jax): the interpreted forward gives the same o and final state either way,
    bit for bit (fails when the transpose is dropped)."""
    from fla_jax.ops.gated_delta_rule import mosaic_fwd_ws
    outs = []
    for identity in (True, False):
        monkeypatch.setattr(mosaic_fwd_ws, "IDENTITY_V_T", identity)
        outs.append(_small_forward(3))
    for a, b in zip(*outs):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert "gdn_fwd_ws" in _lower(128, "bf16", varlen=True, backward=False)


def test_ws_forward_later_in_kernel(monkeypatch):
    """mosaic_fwd_ws.LATER_IN_KERNEL (opt-in): the update's decay exp2(G_last - G) from G's
    columns in registers instead of the G_last - G vector. Interpreted, the forward's o and
    final state match the default's to fp32 rounding of the decays (fails when the decay is off
    by 2^-10 in log2 units); the kernel lowers, and its program no longer reads G_last - G."""
    from fla_jax.ops.gated_delta_rule import mosaic_fwd_ws
    outs = []
    for in_kernel in (False, True):
        monkeypatch.setattr(mosaic_fwd_ws, "LATER_IN_KERNEL", in_kernel)
        outs.append(_small_forward(5))
    (o0, h0_), (o1, h1) = outs
    assert np.isfinite(np.asarray(h1)).all()
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0_), rtol=1e-5, atol=1e-5)
    # o in bf16: at most one rounding step apart
    np.testing.assert_allclose(np.asarray(o1, np.float32), np.asarray(o0, np.float32),
                               rtol=2 ** -7, atol=1e-3)
    texts = {}
    # the XLA gate vectors (mosaic_gates.GATES = "xla"), whose G_last - G is an XLA subtract
    from fla_jax.ops.gated_delta_rule import mosaic_gates
    monkeypatch.setattr(mosaic_gates, "GATES", "xla")
    for in_kernel in (False, True):
        monkeypatch.setattr(mosaic_fwd_ws, "LATER_IN_KERNEL", in_kernel)
        texts[in_kernel] = _lower(128, "bf16", varlen=True, backward=False)
        assert "gdn_fwd_ws" in texts[in_kernel]
    # G_last - G (an XLA subtract) is formed only for the default kernel
    assert texts[True].count("stablehlo.subtract") < texts[False].count("stablehlo.subtract")


@pytest.mark.parametrize("case", ["mos_dr_gqa_h0_t100", "mos_dr_strong"])
def test_one_warpgroup_gradients_interpreted(case, monkeypatch):
    """mosaic_bwd_grads.WARPGROUPS = 1 (the one-warpgroup kernel, no longer the default): the
    same gradients against float64 in fp16 (the tighter tolerances)."""
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    monkeypatch.setattr(mosaic_bwd_grads, "WARPGROUPS", 1)
    with gpu_interpret():
        assert_passed(check("chunk_gated_delta_rule", case, "fp16", {"jax": "mosaic"}))


@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("gated", [True, False])
def test_gradient_kernel_variants_lower(gated, warpgroups, mosaic_backward, monkeypatch):
    """Both gradient kernels lower; two warpgroups (the default) fit shared memory at K = V = 128
    only with beta B in the dq staging tile."""
    monkeypatch.setattr(mosaic_bwd_grads, "WARPGROUPS", warpgroups)
    text = _lower(128, "bf16", varlen=False, backward=True, gated=gated)
    assert "gdn_bwd_grads" in text and pallas_chunk_calls(text) == 0
    assert ("gdn_bwd_grads_ws" in text) == (warpgroups == 2)


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


def _t0_float64(k, beta, group):
    """(I + tril(beta_i k_i . k_j, -1))^-1 per chunk and value head, float64, [HV, R, C]."""
    R, H, _ = k.shape
    out = np.zeros((H * group, R, C))
    for n in range(R // C):
        rows = slice(n * C, (n + 1) * C)
        for hv in range(H * group):
            kc = k[rows, hv // group]
            a = np.tril(beta[rows, hv][:, None] * (kc @ kc.T), -1)
            out[hv, rows] = np.linalg.inv(np.eye(C) + a)
    return out


@pytest.mark.parametrize("merge", ["hilo", "fp16"])
@pytest.mark.parametrize("keys,beta_range,dtype", [
    ("random", (0.05, 1.95), "bf16"), ("random", (0.05, 1.95), "fp16"),
    ("parallel", (0.05, 1.0), "bf16"), ("parallel", (1.0, 1.95), "fp16")])
def test_t0_kernel_against_float64(keys, beta_range, dtype, merge, monkeypatch):
    """mosaic_kkt's T0 against float64 (rel. RMS). MERGE="hilo" (opt-in) within the output
    dtype's rounding (fp16 1e-3, bf16 4e-3: the XLA inverse's errors are 1.2e-4 / 9e-4 here);
    the default float16-operand merges within 4e-3 in both dtypes (bf16 operands, "single",
    reach ~1e-2 with nearly parallel keys; fp16 activations: T0 ~10x its rounding, the op's
    outputs within 1.03x of hilo's error on the GPU cases, RESULTS.md run 24). Nearly parallel
    keys with beta near 2 make (I + A)^-1 large: a power-product inverse lost every digit there
    (0.14)."""
    assert mosaic_kkt.MERGE == "fp16"
    monkeypatch.setattr(mosaic_kkt, "MERGE", merge)
    rng = np.random.default_rng(1)
    R, H, K, group = 2 * C, 2, 64, 2
    k = rng.standard_normal((R, H, K))
    if keys == "parallel":
        k = rng.standard_normal((1, H, K)) + 0.3 * k
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(*beta_range, (R, H * group))
    kq = jnp.asarray(k, DT[dtype])
    ref = _t0_float64(np.asarray(kq.astype(jnp.float32), np.float64), beta, group)
    with gpu_interpret():
        got, = gate_free_inverse_mosaic(kq, jnp.asarray(beta.T, jnp.float32), group, DT[dtype])
    got = np.asarray(got.astype(jnp.float32), np.float64)
    err = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2))
    assert err < ({"bf16": 4e-3, "fp16": 1e-3}[dtype] if merge == "hilo" else 4e-3), err


def _t0_inputs(seed, chunks, K=64, V=128, group=2):
    """Inputs of gate_free_inverse_mosaic with the WY factors: unit-norm bf16 keys [R, 1, K],
    beta in (0.05, 1.95) as [HV, R] (and [R, HV] float64 for _t0_float64), a chunk-local gate
    cumsum [HV, R], bf16 v [R, HV, V]; R = chunks * C. Returns kq, bt, g, v, beta, group."""
    rng = np.random.default_rng(seed)
    R, HV = chunks * C, group
    k = rng.standard_normal((R, 1, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0.05, 1.95, (R, HV))
    g = np.cumsum(-rng.uniform(0, 2, (HV, chunks, C)), -1).reshape(HV, R)
    v = rng.standard_normal((R, HV, V))
    return (jnp.asarray(k, jnp.bfloat16), jnp.asarray(beta.T, jnp.float32),
            jnp.asarray(g, jnp.float32), jnp.asarray(v, jnp.bfloat16), beta, group)


@pytest.mark.parametrize("chunks_per_cta", [2, 3])
def test_t0_kernel_several_chunks_per_cta(chunks_per_cta, monkeypatch):
    """mosaic_kkt.CHUNKS_PER_CTA > 1 (the default for T0 + -W', the training forward's):
    double-buffered inputs, a partial last group (5 chunks in groups of 2 or 3); T0, -W' and
    U^T equal the one-chunk kernel's, bit for bit (the same operations per chunk), and T0
    matches float64. The default count: 1 for T0 alone and with U^T, 4 for T0 + -W'."""
    assert mosaic_kkt.CHUNKS_PER_CTA is None
    assert [mosaic_kkt.chunks_per_cta(wy, u) for wy, u in ((False, False), (True, False),
                                                            (True, True))] == [1, 4, 1]
    kq, bt, g, v, beta, group = _t0_inputs(2, 5)
    with gpu_interpret():
        one = gate_free_inverse_mosaic(kq, bt, group, jnp.bfloat16, gcum=g, v_rows=v)
        monkeypatch.setattr(mosaic_kkt, "CHUNKS_PER_CTA", chunks_per_cta)
        many = gate_free_inverse_mosaic(kq, bt, group, jnp.bfloat16, gcum=g, v_rows=v)
    for a, b in zip(one, many):
        assert a.shape == b.shape and not np.isnan(np.asarray(b, np.float32)).any()
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    ref = _t0_float64(np.asarray(kq.astype(jnp.float32), np.float64), beta, group)
    got = np.asarray(many[0].astype(jnp.float32), np.float64)
    assert np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)) < 4e-3
    with pytest.raises(ValueError, match="v_rows .* without gcum"):    # U^T needs the gates
        gate_free_inverse_mosaic(kq, bt, group, jnp.bfloat16, v_rows=v)
    with gpu_interpret():     # -W' alone (the training forward's residual): the same values
        t0_w = gate_free_inverse_mosaic(kq, bt, group, jnp.bfloat16, gcum=g)
    assert len(t0_w) == 2
    for a, b in zip(many[:2], t0_w):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("block", [64, 32, 16])
def test_substitution_stream_on_numpy(block):
    """The lane-level solve's instruction stream (substitution.substitute for each thread's
    column, threads and rows assigned as substitution.lanes_of assigns them), run on float32
    NumPy values as the kernel runs it: the rows of -A^T read from one buffer, every x_jc of the
    solved rows then stored unconditionally into a zero-filled second buffer. Gives the inverse
    of A's diagonal blocks to float32 accuracy, for A strictly lower with large entries, with
    exact zeros above the diagonal (the stored x_jc, j < c) and outside the blocks."""
    from fla_jax.ops.common.mosaic.substitution import lanes_of, substitute
    rng = np.random.default_rng(6)
    a = np.tril(rng.uniform(-1.5, 1.5, (C, C)), -1).astype(np.float32)
    na = (-a.T).copy()                  # row j: column j of -A
    x = np.zeros((C, C), np.float32)
    for lo, hi, n, first in lanes_of(C, block):
        for t in range(lo, hi):
            row0 = t - t % n if first is None else first
            xs = substitute(n, lambda i, own=t - row0: np.float32(i == own),
                            lambda j, i0, row0=row0: na[row0 + j, row0 + i0:row0 + i0 + 4].copy(),
                            lambda p, q, r: np.float32(p * q + r))
            for j, v in enumerate(xs):
                x[row0 + j, t] = v
    np.testing.assert_array_equal(na, -a.T)            # only read
    r, c = np.indices((C, C))
    keep = (r >= c) & (r // block == c // block)
    assert (x[~keep] == 0).all()
    want = np.linalg.inv(np.eye(C) + np.where(keep, a, 0.0).astype(np.float64))
    assert np.isfinite(x).all()
    assert np.abs(x - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("chunks_per_cta", [1, 2])
def test_t0_by_substitution(chunks_per_cta, monkeypatch):
    """mosaic_kkt.INVERSE = "substitution" (the default since run 19; common/mosaic/
    substitution.py, lane-level code that only a GPU runs: the interpreter solves with XLA in its
    place) and "doubling" (selectable); the substitution whole (SUBST_BLOCK 64) or on the
    diagonal 32 / 16 blocks completed by doubling levels. Interpreted, the kernel's data flow
    around the solve (-A^T from k k^T and beta as columns, the doubling levels, the WY factors)
    gives T0 within bf16 rounding of float64 and the doubling's -W' and U^T; they lower for CUDA
    (one and several chunks per CTA)."""
    kq, bt, g, v, beta, group = _t0_inputs(4, 3)
    monkeypatch.setattr(mosaic_kkt, "CHUNKS_PER_CTA", chunks_per_cta)
    outs = []
    for inverse, block, merge in (("doubling", 64, "hilo"), ("substitution", 64, "hilo"),
                                  ("substitution", 32, "hilo"), ("substitution", 16, "hilo"),
                                  ("substitution", 16, "single"), ("substitution", 32, "fp16"),
                                  ("substitution", 16, "fp16")):
        monkeypatch.setattr(mosaic_kkt, "INVERSE", inverse)
        monkeypatch.setattr(mosaic_kkt, "SUBST_BLOCK", block)
        monkeypatch.setattr(mosaic_kkt, "MERGE", merge)
        with gpu_interpret():
            outs.append([np.asarray(x.astype(jnp.float32), np.float64) for x in
                         gate_free_inverse_mosaic(kq, bt, group, jnp.bfloat16, gcum=g,
                                                  v_rows=v)])
    ref = _t0_float64(np.asarray(kq.astype(jnp.float32), np.float64), beta, group)
    for got in outs:
        assert np.sqrt(np.mean((got[0] - ref) ** 2) / np.mean(ref ** 2)) < 4e-3
    for other in outs[1:]:
        for a, b in zip(outs[0][1:], other[1:]):          # -W', U^T
            assert np.isfinite(b).all()
            assert np.sqrt(np.mean((a - b) ** 2) / np.mean(a ** 2)) < 1e-2
    for inverse, block in (("doubling", 64), ("substitution", 64), ("substitution", 16)):
        monkeypatch.setattr(mosaic_kkt, "INVERSE", inverse)
        monkeypatch.setattr(mosaic_kkt, "SUBST_BLOCK", block)
        assert "gdn_kkt_inverse" in _lower(128, "bf16", varlen=True, backward=False)
    monkeypatch.setattr(mosaic_kkt, "MERGE", "fast")
    with pytest.raises(ValueError, match="MERGE='fast'"):
        gate_free_inverse_mosaic(kq, bt, group, jnp.bfloat16)
    monkeypatch.setattr(mosaic_kkt, "MERGE", "hilo")
    monkeypatch.setattr(mosaic_kkt, "SUBST_BLOCK", 8)
    with pytest.raises(ValueError, match="SUBST_BLOCK=8"):
        gate_free_inverse_mosaic(kq, bt, group, jnp.bfloat16)
    monkeypatch.setattr(mosaic_kkt, "INVERSE", "inverse")
    with pytest.raises(ValueError, match="INVERSE='inverse'"):
        gate_free_inverse_mosaic(kq, bt, group, jnp.bfloat16)


def test_t0_kernel_several_chunks_per_cta_lowers(monkeypatch):
    monkeypatch.setattr(mosaic_kkt, "CHUNKS_PER_CTA", 8)
    assert "gdn_kkt_inverse" in _lower(128, "bf16", varlen=True, backward=True)
    assert "gdn_kkt_inverse" in _lower(256, "fp16", varlen=False, backward=False)


def test_t0_kernel_in_the_op(monkeypatch):
    """The op with T0 and the WY factors -W' and U^T from the Mosaic kernel (FORWARD="wy": the
    forward of K = 256 and of TRAIN_WS off; the other interpreted cases run "ws") against the
    float64 oracle, interpreted; it lowers for CUDA."""
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    monkeypatch.setattr(mosaic_chunk, "FORWARD", "wy")
    with gpu_interpret():
        assert_passed(check("chunk_gated_delta_rule", "mos_dr_gqa_h0_t100", "bf16",
                            {"jax": "mosaic"}))
    assert "gdn_kkt_inverse" in _lower(128, "fp16", varlen=True, backward=True)


def test_ws_forward_stages(monkeypatch):
    """mosaic_fwd_ws.plan: three input stages at K = 128 when v^T comes from the transposed
    register load (jax >= 0.11, IDENTITY_V_T off: 219 KB), two with the identity tile (jax
    0.10.2, or IDENTITY_V_T on), every plan within SMEM_BUDGET; MAX_STAGES caps it."""
    from fla_jax.ops.gated_delta_rule import mosaic_fwd_ws as ws
    for lowers, identity, K, expect in ((True, False, 128, (3, False)),
                                        (False, False, 128, (2, True)),
                                        (True, True, 128, (2, True)),
                                        (True, False, 64, (3, False)),
                                        (False, False, 64, (3, True))):
        monkeypatch.setattr(ws, "transposed_load_lowers", lambda lowers=lowers: lowers)
        monkeypatch.setattr(ws, "IDENTITY_V_T", identity)
        assert ws.plan(K, jnp.bfloat16) == expect, (lowers, identity, K)
        assert ws.smem_bytes(K, jnp.bfloat16) <= ws.SMEM_BUDGET
    assert ws.smem_bytes(128, jnp.bfloat16, 3, True) > ws.SMEM_BUDGET
    monkeypatch.setattr(ws, "MAX_STAGES", 2)
    assert ws.plan(128, jnp.float16) == (2, True)
    assert ws.plan(256, jnp.bfloat16)[0] == 0 or not ws.supports(256, jnp.bfloat16)


def test_warp_specialized_forward_choice(monkeypatch):
    """FORWARD="ws" (the default): the forward at K <= 128 is the three-warpgroup kernel fed by
    the T0 kernel (T0 only; in training T0 and -W', and the kernel stores the residuals);
    K = 256 (its stages do not fit shared memory), training with TRAIN_WS off and FORWARD="wy"
    keep the one-warpgroup kernel; a bad FORWARD is refused."""
    from fla_jax.ops.gated_delta_rule import mosaic_fwd_ws
    assert mosaic_chunk.FORWARD == "ws"
    for dt in (jnp.bfloat16, jnp.float16):
        assert mosaic_fwd_ws.supports(128, dt) and not mosaic_fwd_ws.supports(256, dt)
        assert mosaic_fwd_ws.smem_bytes(128, dt) <= mosaic_fwd_ws.SMEM_BUDGET
    assert "gdn_fwd_ws" in _lower(64, "fp16", varlen=True, backward=False, V=128)
    assert "gdn_fwd_ws" not in _lower(256, "bf16", varlen=False, backward=False, V=64)
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    assert "gdn_fwd_ws" in _lower(128, "bf16", varlen=False, backward=True)
    monkeypatch.setattr(mosaic_chunk, "TRAIN_WS", False)
    text = _lower(128, "bf16", varlen=False, backward=True)
    assert "gdn_fwd" in text and "gdn_fwd_ws" not in text
    monkeypatch.setattr(mosaic_chunk, "FORWARD", "fast")
    with pytest.raises(ValueError, match="FORWARD: got 'fast'"):
        _lower(128, "bf16", varlen=False, backward=False)


def test_reverse_pass_choice(monkeypatch):
    """mosaic_bwd.REVERSE = "ws" (the default): the reverse state pass is the three-warpgroup
    kernel reading T0 (the training forward's T0 kernel forms no -W'); "wy" and the "wy"
    training forward keep the one-warpgroup pass reading -W'; a bad REVERSE is refused. The
    interpreted cases above run "ws" (checked to fail with dv_new^T Ag's sign flipped)."""
    from fla_jax.ops.gated_delta_rule import mosaic_bwd, mosaic_bwd_states_ws
    assert mosaic_bwd.REVERSE == "ws"
    for dt in (jnp.bfloat16, jnp.float16):
        assert mosaic_bwd_states_ws.supports(128, dt)
        assert mosaic_bwd_states_ws.smem_bytes(128, dt) <= mosaic_bwd_states_ws.SMEM_BUDGET
    monkeypatch.setattr(mosaic_chunk, "BACKWARD", "mosaic")
    text = _lower(128, "bf16", varlen=True, backward=True)
    assert "gdn_bwd_states_ws" in text
    monkeypatch.setattr(mosaic_bwd, "REVERSE", "wy")
    text = _lower(128, "bf16", varlen=True, backward=True)
    assert "gdn_bwd_states" in text and "gdn_bwd_states_ws" not in text
    monkeypatch.setattr(mosaic_bwd, "REVERSE", "ws")
    monkeypatch.setattr(mosaic_chunk, "TRAIN_WS", False)
    text = _lower(64, "fp16", varlen=False, backward=True)
    assert "gdn_bwd_states" in text and "gdn_bwd_states_ws" not in text
    monkeypatch.setattr(mosaic_bwd, "REVERSE", "fast")
    with pytest.raises(ValueError, match="REVERSE: got 'fast'"):
        _lower(128, "bf16", varlen=False, backward=True)


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_delta_rule"])
def test_auto_takes_mosaic_on_hopper(op, monkeypatch):
    """impl='auto' on a (pretended) Hopper GPU: 'mosaic' for bf16 / fp16 calls the kernels
    take (AUTO_MOSAIC, GPU-proven), the previous choice for fp32 and for head sizes they
    refuse; off Hopper never."""
    from fla_jax.ops.common.mosaic import dispatch as mdispatch
    q = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
    reason = lambda x: (lambda: mosaic_unsupported_reason(x, x, x))  # noqa: E731
    assert mdispatch.mosaic_or(op, "auto", q, reason(q)) == "auto"          # CPU
    monkeypatch.setattr(mdispatch, "on_hopper", lambda: True)
    for dt in (jnp.bfloat16, jnp.float16):
        x = q.astype(dt)
        assert mdispatch.mosaic_or(op, "auto", x, reason(x)) == "mosaic"
    x32 = q.astype(jnp.float32)
    assert mdispatch.mosaic_or(op, "auto", x32, reason(x32)) == "auto"
    odd = jnp.zeros((1, 64, 1, 96), jnp.bfloat16)
    assert mdispatch.mosaic_or(op, "auto", odd, reason(odd)) == "auto"
    assert mdispatch.mosaic_or(op, "pallas", q, reason(q)) == "pallas"
