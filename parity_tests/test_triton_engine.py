"""Gate switch of the Triton chunk engine: simple GLA (GATE_SCALAR, and GATE_NONE without a
gate) computed by the engine (fla_torch/ops/simple_gla/triton_engine_chunk.py) against the
float64 oracle on the shared harness's inputs and tolerance table. The dedicated simple-GLA
kernels (CHUNK_IMPLS['triton']) are tested in test_triton_simple_gla.py.
"""
from __future__ import annotations

import os

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402,F401

from parity_tests import triton_interpret_patch  # noqa: E402
from parity_tests.cases import CASES, rel_rms, tolerance  # noqa: E402
from parity_tests.harness import inputs, oracle  # noqa: E402
from parity_tests.torch_runner import DTYPES, poisoned_allocations  # noqa: E402

triton_interpret_patch.apply()

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"
RUNS = [("basic", "fp32"), ("basic", "bf16"), ("gamma", "fp32"), ("both_gates", "fp32"),
        ("no_gate", "bf16"), ("uniform_strong", "fp32"), ("short_strong", "fp16")]


@pytest.mark.parametrize("case,dtype", RUNS, ids=[f"{c}-{d}" for c, d in RUNS])
def test_engine_simple_gla(case, dtype):
    from fla_torch.ops.simple_gla.triton_engine_chunk import chunk_simple_gla_engine
    op = "chunk_simple_gla"
    x = inputs(op, case, dtype)
    ref = oracle(op, case, dtype, DEVICE)
    c = CASES[case]
    dt = DTYPES[dtype]

    def leaf(name, d):
        return torch.tensor(x[name], dtype=d, device=DEVICE, requires_grad=True)

    q, k, v = (leaf(n, dt) for n in ("q", "k", "v"))
    leaves = {"dq": q, "dk": k, "dv": v}
    kw = {}
    if "g" in x:
        kw["g"] = leaves["dg"] = leaf("g", torch.float32)
    if "g_gamma" in x:
        kw["g_gamma"] = torch.tensor(x["g_gamma"], dtype=torch.float32, device=DEVICE)
    if "h0" in x:
        kw["initial_state"] = leaves["dh0"] = leaf("h0", torch.float32)
    if c.cu_seqlens is not None:
        kw["cu_seqlens"] = torch.tensor(c.cu_seqlens, dtype=torch.int32, device=DEVICE)
    with poisoned_allocations():
        o, ht = chunk_simple_gla_engine(q, k, v, **kw, scale=q.shape[-1] ** -0.5,
                                        output_final_state=True)
        do = torch.tensor(x["do"], dtype=o.dtype, device=DEVICE)
        dht = torch.tensor(x["dht"], dtype=ht.dtype, device=DEVICE)
        grads = torch.autograd.grad((o, ht), list(leaves.values()), (do, dht))
    got = {"o": o, "ht": ht, **dict(zip(leaves, grads))}
    bad = []
    for name, t in got.items():
        err = rel_rms(t.detach().double().cpu().numpy(), ref[name], ref[name])
        if not err <= tolerance(dtype, name):
            bad.append(f"{name} err={err:.3e} tol={tolerance(dtype, name):.1e}")
    assert not bad, "\n".join(bad)
