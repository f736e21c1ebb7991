"""Triton fused_recurrent KDA and RWKV-7 kernels (forward and backward): the cases that
test_ops.py's CPU kernel subset leaves out, on the shared harness (cases.Case, harness.check:
one input generator, the float64 oracle, NaN-poisoned allocations, one metric and the one
tolerance table).

Covered here (cases.DPLR_KERNEL_CASES): varlen with an empty sequence, short ones and one that
crosses a state checkpoint of the backward; no initial state with K != V (V tiled over two
programs, masked); per-channel gates in [-20, -1] in fp32 / bf16 / fp16; K = V = 256; a decode
step (T = 1) chained through the final state; no final state. Interpreted on CPU
(TRITON_INTERPRET=1, set by conftest) or on a GPU with PARITY_DEVICE=cuda.
"""
from __future__ import annotations

import os

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402,F401  (the suite needs every framework: no silent skip)

from parity_tests import triton_interpret_patch  # noqa: E402
from parity_tests.cases import TOLERANCE, rel_rms  # noqa: E402
from parity_tests.harness import check  # noqa: E402

triton_interpret_patch.apply()

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"

ROWS = [
    ("fused_recurrent_kda", "dplr_varlen_kv", "bf16"),
    ("fused_recurrent_rwkv7", "dplr_varlen_kv", "fp32"),
    ("fused_recurrent_rwkv7", "dplr_strong", "fp32"),
    ("fused_recurrent_kda", "dplr_strong", "fp32"),
    ("fused_recurrent_kda", "dplr_strong", "fp16"),
    ("fused_recurrent_rwkv7", "dplr_strong", "bf16"),
    ("fused_recurrent_kda", "dplr_k256", "bf16"),
    ("fused_recurrent_rwkv7", "dplr_k256", "fp32"),
]


@pytest.mark.parametrize("op,case,dtype", ROWS, ids=["-".join(r) for r in ROWS])
def test_fused_recurrent_dplr_triton(op, case, dtype):
    rows = check(op, case, dtype, {"torch": "triton"}, device=DEVICE)
    bad = [f"{r.compared} {r.tensor} err={r.error:.3e} tol={r.tolerance:.1e}"
           for r in rows if not r.passed]
    assert rows and not bad, "\n".join(bad)


def _rwkv7_inputs(gen, T, H, K, V):
    r = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen) / K ** 0.5
    v = torch.randn(1, T, H, V, generator=gen)
    w = -20 * torch.rand(1, T, H, K, generator=gen)
    kk = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    return r, k, v, w, -kk, kk * torch.rand(1, T, H, K, generator=gen)


def test_decode_steps_match_one_call():
    """Token-by-token calls chained through the final state equal one call (fp32)."""
    from fla_torch.ops import fused_recurrent_kda, fused_recurrent_rwkv7
    gen = torch.Generator().manual_seed(3)
    T, H, K, V = 5, 2, 16, 32
    r, k, v, w, a, b = (x.to(DEVICE) for x in _rwkv7_inputs(gen, T, H, K, V))
    beta = torch.rand(1, T, H, generator=gen).to(DEVICE)
    h0 = torch.randn(1, H, K, V, generator=gen).to(DEVICE)
    calls = {
        "rwkv7": lambda s, e, h: fused_recurrent_rwkv7(
            r[:, s:e], w[:, s:e], k[:, s:e], v[:, s:e], a[:, s:e], b[:, s:e],
            initial_state=h, output_final_state=True, impl="triton"),
        "kda": lambda s, e, h: fused_recurrent_kda(
            r[:, s:e], k[:, s:e], v[:, s:e], w[:, s:e], beta[:, s:e], initial_state=h,
            output_final_state=True, use_qk_l2norm_in_kernel=True, impl="triton"),
    }
    for name, call in calls.items():
        o_all, h_all = call(0, T, h0)
        h, outs = h0, []
        for t in range(T):
            o_t, h = call(t, t + 1, h)
            outs.append(o_t)
        torch.testing.assert_close(torch.cat(outs, 1), o_all, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(h, h_all, rtol=1e-5, atol=1e-5, msg=name)


def test_no_final_state_bf16():
    """output_final_state=False: no final state, the same output and gradients (bf16)."""
    from fla_torch.ops import fused_recurrent_rwkv7
    gen = torch.Generator().manual_seed(5)
    x = _rwkv7_inputs(gen, 70, 1, 16, 16)
    do = torch.randn(1, 70, 1, 16, generator=gen).to(torch.bfloat16)
    out = {}
    for impl, dt, gd in (("triton", torch.bfloat16, torch.float32),
                         ("reference", torch.float64, torch.float64)):
        r, k, v = (t.to(dt).to(torch.float64 if impl == "reference" else dt) for t in x[:3])
        leaves = [t.detach().to(DEVICE).clone().requires_grad_()
                  for t in (r, k, v) + tuple(t.to(gd) for t in x[3:])]
        r, k, v, w, a, b = leaves
        o, ht = fused_recurrent_rwkv7(r, w, k, v, a, b, output_final_state=False, impl=impl)
        assert ht is None
        o.backward(do.to(o.dtype).to(DEVICE))
        out[impl] = [o] + [t.grad for t in leaves]
    names = ("o", "dr", "dw", "dk", "dv", "da", "db")
    for name, t, ref in zip(names, out["triton"], out["reference"]):
        ref = ref.detach().double().cpu().numpy()
        err = rel_rms(t.detach().double().cpu().numpy(), ref, ref)
        assert err <= TOLERANCE["bf16"][name], f"{name}: {err:.3e}"
