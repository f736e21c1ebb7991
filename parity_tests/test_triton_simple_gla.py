"""Triton simple-GLA kernels (chunk_simple_gla, fused_recurrent_simple_gla): the cases that
test_ops.py's CPU kernel subset leaves out, as a case list on the shared harness (cases.Case /
make_inputs, harness.check: the float64 oracle, NaN-poisoned allocations, cases.rel_rms and the
one tolerance table).

Covered here: g / g_gamma / both / no gate, an explicit scale, no initial state, varlen with an
empty sequence and sequences shorter than a chunk, T not a multiple of 64, K and V from 16 to 256
(100: masked, not a power of two), gates from 0.01 to -20 per token (fp32 dg under gates in
[-20, -1] and [-20, -10] over several chunks), bf16 / fp16 / fp32 and tf32 on request,
output_final_state=False under no_grad, and the head-size limit's error. Interpreted on CPU
(TRITON_INTERPRET=1, set by conftest or here) or on a GPU with PARITY_DEVICE=cuda.
"""
from __future__ import annotations

import os

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402,F401  (the suite needs every framework: no silent skip)

from parity_tests import torch_runner, triton_interpret_patch  # noqa: E402
from parity_tests.cases import CASES, OPS, make_inputs, rel_rms, seed_of, tolerance  # noqa: E402
from parity_tests.harness import assert_passed, check, inputs  # noqa: E402

triton_interpret_patch.apply()

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"
ALL = ("fp32", "bf16", "fp16")


def _rows(*entries):
    """(case, dtypes) -> [(case, dtype), ...]"""
    return [(c, d) for c, dts in entries for d in dts]


# test_ops.py's kernel subset already runs basic (bf16), varlen / gamma (fp32) and
# short_strong (fp16) for both ops; these are other dtypes and cases.
CHUNK = _rows(
    ("t63_kv_weak", ALL), ("varlen", ("bf16", "fp16")), ("sgla_varlen_short", ALL),
    ("sgla_strong", ALL), ("short_strong", ("fp32",)), ("sgla_weak", ALL),
    ("gamma", ("bf16", "fp16")), ("both_gates", ALL), ("no_gate", ALL), ("sgla_k100", ALL),
    ("sgla_k16_v256", ALL), ("sgla_k256_v24_no_h0", ALL), ("sgla_scale", ("fp32",)),
    ("sgla_uniform_strong_long", ("fp32",)),
)
# the interpreted token loop is slow: one dtype per case
RECURRENT = _rows(
    ("sgla_varlen_short", ("bf16",)), ("sgla_strong", ("fp16",)), ("both_gates", ("fp32",)),
    ("no_gate", ("bf16",)), ("sgla_k100", ("fp32",)), ("sgla_scale", ("fp32",)),
    ("sgla_strong_long", ("fp32",)),
)


@pytest.mark.parametrize("case,dtype", CHUNK, ids=[f"{c}-{d}" for c, d in CHUNK])
def test_chunk_simple_gla_triton(case, dtype):
    assert_passed(check("chunk_simple_gla", case, dtype, {"torch": "triton"}, device=DEVICE))


@pytest.mark.parametrize("case,dtype", RECURRENT, ids=[f"{c}-{d}" for c, d in RECURRENT])
def test_fused_recurrent_simple_gla_triton(case, dtype):
    assert_passed(check("fused_recurrent_simple_gla", case, dtype, {"torch": "triton"},
                        device=DEVICE))


def test_chunk_tf32():
    """tf32 on request: fp32 inputs held to the fp16 row of the table, not fp32's."""
    from fla_torch import dtypes
    with dtypes.allow_tf32():
        rows = check("chunk_simple_gla", "basic", "fp32", {"torch": "triton"}, device=DEVICE)
    for r in rows:
        r.tolerance = tolerance("fp16", r.tensor)
    assert_passed(rows)


@pytest.mark.parametrize("op", ["chunk_simple_gla", "fused_recurrent_simple_gla"])
def test_no_final_state_and_no_grad(op):
    """output_final_state=False under no_grad (bf16, varlen): no final state, the same o."""
    import fla_torch.ops as ops
    spec, case = OPS[op], CASES["sgla_varlen_short"]
    raw = make_inputs(spec, case, seed_of(op, "no_final_state"))
    x = {n: torch_runner.round_to("bf16" if n in "qkv" else "fp32", a) for n, a in raw.items()}
    ref = torch_runner.run(spec, case, "reference", "fp64", x)["o"]
    cu = torch.tensor(case.cu_seqlens, dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.tensor(x[n], dtype=torch.bfloat16, device=DEVICE) for n in "qkv")
    g, h0 = (torch.tensor(x[n], dtype=torch.float32, device=DEVICE) for n in ("g", "h0"))
    with torch.no_grad(), torch_runner.poisoned_allocations():
        o, ht = getattr(ops, op)(q, k, v, g=g, initial_state=h0, output_final_state=False,
                                 cu_seqlens=cu, impl="triton")
    assert ht is None and o.dtype == torch.bfloat16
    err = rel_rms(o.double().cpu().numpy(), ref, ref)
    assert err <= tolerance("bf16", "o"), f"{op} o: {err:.3e}"


def test_head_dim_limit_is_named():
    from fla_torch.ops.simple_gla import triton_chunk, triton_recurrent
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


def test_interpreter_device_call_shortcut_is_exact(monkeypatch):
    """triton_interpret_patch skips the interpreter's re-patching of triton.language on device
    calls (tl.sum, tl.cumsum, helpers) inside a launch: the chunk kernels' outputs and
    gradients are bit-identical with the original device call, and the shortcut was taken."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter patch applies only under TRITON_INTERPRET=1; a GPU "
                    "run compiles the kernels")
    from triton.runtime import interpreter
    call = interpreter.InterpretedFunction.__call__
    assert getattr(call, "__wrapped__", None) is not None
    passes = []
    original = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: passes.append(fn) or original(fn))
    spec, case = OPS["chunk_simple_gla"], CASES["basic"]
    x = inputs("chunk_simple_gla", "basic", "fp32")
    runs = []
    for shortcut in (True, False):
        if not shortcut:
            monkeypatch.setattr(interpreter.InterpretedFunction, "__call__", call.__wrapped__)
        passes.clear()
        runs.append((torch_runner.run(spec, case, "triton", "fp32", x), len(passes)))
    (fast, n_fast), (slow, n_slow) = runs
    assert n_fast < n_slow, (n_fast, n_slow)      # device calls took the shortcut
    assert fast.keys() == slow.keys()
    for k in fast:
        np.testing.assert_array_equal(fast[k], slow[k], err_msg=k)


def test_interpreter_dtype_table_matches():
    """triton_interpret_patch's dtype table answers what the interpreter's own lookup does."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter patch applies only under TRITON_INTERPRET=1; a GPU "
                    "run compiles the kernels")
    import triton.language as tl
    from triton.runtime import interpreter
    fast = interpreter._get_np_dtype
    slow = fast.__wrapped__
    types = [tl.int1, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int8, tl.uint8,
             tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float8e5,
             tl.float8e4nv, tl.pointer_type(tl.bfloat16)]
    types += [tl.block_type(t, [4, 8]) for t in types]
    for t in types:
        assert fast(t) == slow(t), t
    with pytest.raises(KeyError):
        fast(tl.void)
