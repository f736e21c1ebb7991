"""Kernel tests of the Triton simple-GLA ops (chunk and fused_recurrent) on CPU, interpreted.

Every feature of issue 3 point 3 on small shapes: g / g_gamma / both / no gate, scale,
initial_state, output_final_state, cu_seqlens (sequences shorter than a chunk, an empty one,
T not a multiple of 64), K and V from 16 to 256 (non-powers of two masked), bf16 / fp16 / fp32
(tf32 on request). Outputs are NaN-poisoned before the kernels write them. Each output, state
and gradient is compared with the float64 token-by-token reference fed the same rounded
inputs: RMS(a - b) / RMS(ref) under parity_tests.cases.TOLERANCE.

TRITON_INTERPRET=1 must be set before triton is imported; parity_tests/conftest.py sets it for
the whole suite (and applies triton_interpret_patch); it is also set here when this file is run
on its own. With PARITY_DEVICE=cuda the same tests run on the GPU.
"""
from __future__ import annotations

import os
import zlib

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402  (the suite needs every framework: no silent skip)

from parity_tests import triton_interpret_patch  # noqa: E402
from parity_tests.cases import TOLERANCE  # noqa: E402

triton_interpret_patch.apply()

from fla_torch import dtypes  # noqa: E402
from fla_torch.ops.simple_gla import (  # noqa: E402
    chunk_simple_gla, fused_recurrent_simple_gla, triton_chunk, triton_recurrent)
from fla_torch.ops.simple_gla.reference import simple_gla_reference  # noqa: E402

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPS = {"chunk": chunk_simple_gla, "recurrent": fused_recurrent_simple_gla}


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_chunk, "POISON_OUTPUTS", True)
    monkeypatch.setattr(triton_recurrent, "POISON_OUTPUTS", True)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a = a.detach().double().cpu()
    ref = ref.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    den = ref.pow(2).mean().sqrt().item()
    num = (a - ref).pow(2).mean().sqrt().item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def _draw(B, T, H, K, V, N, gate, strength, h0, dtype, seed):
    """float64 values already rounded to what the kernel sees (dtype / fp32)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": rnd(B, T, H, K).to(dtype).double(),
         "k": (rnd(B, T, H, K) / K ** 0.5).to(dtype).double(),
         "v": rnd(B, T, H, V).to(dtype).double(),
         "do": rnd(B, T, H, V).to(dtype).double(),
         "dht": (0.5 * rnd(N, H, K, V)).float().double()}
    if gate in ("g", "both"):
        u = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
        x["g"] = (-strength * (0.05 + 0.95 * u)).float().double()
    if gate in ("gamma", "both"):
        x["g_gamma"] = (-torch.log2(1 + 2.0 ** -torch.linspace(3, 8, H, dtype=torch.float64))
                        * max(strength, 0.1)).float().double()
    if h0:
        x["h0"] = (0.5 * rnd(N, H, K, V)).float().double()
    return x


def _run(op, impl, x, dtype, cu, scale, to_dtype):
    """Forward + backward of one implementation; returns outputs and gradients (float64)."""
    leaves = {}
    for name in ("q", "k", "v"):
        leaves[name] = x[name].to(to_dtype).to(DEVICE).requires_grad_()
    for name in ("g", "h0"):
        if name in x:
            wanted = torch.float64 if to_dtype == torch.float64 else torch.float32
            leaves[name] = x[name].to(wanted).to(DEVICE).requires_grad_()
    g_gamma = x.get("g_gamma")
    if g_gamma is not None:
        g_gamma = g_gamma.to(torch.float64 if to_dtype == torch.float64 else torch.float32)
        g_gamma = g_gamma.to(DEVICE)
    cus = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    o, ht = OPS[op](leaves["q"], leaves["k"], leaves["v"], g=leaves.get("g"), g_gamma=g_gamma,
                    scale=scale, initial_state=leaves.get("h0"), output_final_state=True,
                    cu_seqlens=cus, impl=impl)
    state_dtype = ht.dtype
    torch.autograd.backward([o, ht], [x["do"].to(o.dtype).to(DEVICE),
                                      x["dht"].to(state_dtype).to(DEVICE)])
    out = {"o": o, "ht": ht}
    for name, leaf in leaves.items():
        out["d" + name] = leaf.grad
    return out


# (name, B, T, H, K, V, cu_seqlens, gate, strength, h0)
CASES = [
    ("basic", 2, 100, 2, 32, 32, None, "g", 1.0, True),
    ("t63_kv", 1, 63, 2, 32, 48, None, "g", 0.1, False),
    ("varlen", 1, 300, 2, 32, 32, (0, 15, 100, 300), "g", 0.5, True),
    ("varlen_short", 1, 70, 2, 32, 32, (0, 5, 20, 20, 70), "g", 1.0, True),
    ("strong", 1, 100, 2, 32, 32, None, "g", 10.0, True),
    ("short_strong", 1, 70, 2, 32, 32, (0, 5, 20, 20, 70), "g", 20.0, True),
    ("weak", 1, 100, 2, 32, 32, None, "g", 0.01, True),
    ("gamma", 1, 100, 2, 32, 32, None, "gamma", 1.0, True),
    ("both_gates", 1, 100, 2, 32, 32, None, "both", 1.0, True),
    ("no_gate", 1, 100, 2, 32, 32, None, "none", 0.0, True),
    ("d100", 1, 80, 1, 100, 100, None, "g", 1.0, True),
    ("k16_v256", 1, 70, 1, 16, 256, (0, 64, 70), "g", 1.0, True),
    ("k256_v24", 1, 40, 1, 256, 24, None, "both", 1.0, False),
]
CHUNK_CASES = [c[0] for c in CASES]
# The token loop is slow when interpreted: every dtype on "basic", one dtype on the others.
RECURRENT_CASES = [("basic", "bf16"), ("basic", "fp16"), ("basic", "fp32"),
                   ("varlen_short", "bf16"), ("strong", "fp16"), ("both_gates", "fp32"),
                   ("no_gate", "bf16"), ("d100", "fp32")]


def _check(op, case, dt, scale=None, tol_dtype=None):
    name, B, T, H, K, V, cu, gate, strength, h0 = next(c for c in CASES if c[0] == case)
    N = B if cu is None else len(cu) - 1
    dtype = DTYPES[dt]
    seed = zlib.crc32(f"{op}/{case}/{dt}".encode())
    x = _draw(B, T, H, K, V, N, gate, strength, h0, dtype, seed)
    scale = K ** -0.5 if scale is None else scale
    got = _run(op, "triton", x, dtype, cu, scale, dtype)
    ref = _run("recurrent", "reference", x, torch.float64, cu, scale, torch.float64)
    tol = TOLERANCE[tol_dtype or dt]
    errors = {key: _rel(got[key], ref[key]) for key in ref}
    for key, value in got.items():
        assert value.dtype == (dtype if key in ("o", "dq", "dk", "dv") else torch.float32), key
    bad = {key: (err, tol[key]) for key, err in errors.items() if not err <= tol[key]}
    assert not bad, f"{op}/{case}/{dt}: error > tolerance: {bad} (all: {errors})"


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunk_kernel(case, dt):
    _check("chunk", case, dt)


@pytest.mark.parametrize("case,dt", RECURRENT_CASES)
def test_recurrent_kernel(case, dt):
    _check("recurrent", case, dt)


@pytest.mark.parametrize("op", list(OPS))
def test_scale(op):
    _check(op, "basic", "fp32", scale=0.37)


def test_chunk_tf32():
    """tf32 on request: checked against the bf16/fp16-sized budget (fp16 row), not fp32's."""
    with dtypes.allow_tf32():
        _check("chunk", "basic", "fp32", tol_dtype="fp16")


@pytest.mark.parametrize("op", list(OPS))
def test_no_final_state_and_no_grad(op):
    x = _draw(1, 70, 2, 32, 32, 1, "g", 1.0, True, torch.bfloat16, seed=7)
    q, k, v = (x[n].to(torch.bfloat16).to(DEVICE) for n in ("q", "k", "v"))
    with torch.no_grad():
        o, ht = OPS[op](q, k, v, g=x["g"].float().to(DEVICE), scale=0.2, impl="triton")
    ref, _ = simple_gla_reference(q.double(), k.double(), v.double(), g=x["g"].to(DEVICE),
                                  scale=0.2)
    assert ht is None
    assert o.dtype == torch.bfloat16
    assert _rel(o, ref) <= TOLERANCE["bf16"]["o"]


def test_head_dim_limit_is_named():
    q = torch.zeros(1, 4, 1, 300)
    v = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="K=300"):
        triton_chunk.chunk_simple_gla_triton(q, q, v, scale=1.0)
    with pytest.raises(ValueError, match="K=300"):
        triton_recurrent.fused_recurrent_simple_gla_triton(q, q, v, scale=1.0)


def test_interpreter_patch_is_idempotent():
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert triton_interpret_patch.apply() is False
        return
    assert triton_interpret_patch.apply() is True
    assert triton_interpret_patch.apply() is True
    from triton.runtime import interpreter
    assert getattr(interpreter.InterpreterBuilder.create_dot, "__wrapped__", None) is not None
    assert not hasattr(interpreter.InterpreterBuilder.create_dot.__wrapped__, "__wrapped__")


def test_recurrent_dg_strong_gates_fp32():
    """dg of the recurrent kernel with per-token log-decays in [-20, -1] (fp32, two sequences
    of 60 and 240 tokens, h0 and dS_T given). The true dg is O(exp(g)) small; a kernel that
    forms it from O(1) terms that cancel (q.dq and k.dk both holding scale (q.k)(v.do); the
    final <dS_T, S_T>) is off by ~4e-5 here, over fp32's 2e-5."""
    cu = (0, 60, 300)
    x = _draw(1, 300, 1, 32, 32, 2, "g", 20.0, True, torch.float32, seed=14)
    got = _run("recurrent", "triton", x, torch.float32, cu, 32 ** -0.5, torch.float32)
    ref = _run("recurrent", "reference", x, torch.float64, cu, 32 ** -0.5, torch.float64)
    errors = {key: _rel(got[key], ref[key]) for key in ref}
    bad = {key: err for key, err in errors.items() if not err <= TOLERANCE["fp32"][key]}
    assert not bad, f"strong-gate recurrent fp32: over tolerance {bad} (all: {errors})"


def test_chunk_dg_uniformly_strong_gates_fp32():
    """dg of the chunk kernel with every per-token log-decay in [-20, -10] (fp32, two
    sequences, h0 and dS_T given): each chunk's dg terms are decayed except k_L . dk_L, which
    an in-chunk `cumsum(r) - r` cancelled at the last token (dg error 1.2e-3; with that term
    left out of the prefix sum, 2.1e-7)."""
    cu = (0, 60, 256)
    x = _draw(1, 256, 1, 32, 32, 2, "g", 20.0, True, torch.float32, seed=14)
    u = torch.rand(1, 256, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x["g"] = (-20.0 + 10.0 * u).float().double()
    got = _run("chunk", "triton", x, torch.float32, cu, 32 ** -0.5, torch.float32)
    ref = _run("chunk", "reference", x, torch.float64, cu, 32 ** -0.5, torch.float64)
    errors = {key: _rel(got[key], ref[key]) for key in ref}
    bad = {key: err for key, err in errors.items() if not err <= TOLERANCE["fp32"][key]}
    assert not bad, f"uniformly strong-gate chunk fp32: over tolerance {bad} (all: {errors})"
