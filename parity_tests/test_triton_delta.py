"""Triton delta-rule kernels (chunk / fused_recurrent of delta_rule and gated_delta_rule): the
cases that test_ops.py's CPU kernel subset leaves out, as a case list on the shared harness
(cases.Case / make_inputs, harness.check: the float64 oracle, NaN-poisoned allocations,
cases.rel_rms and the one tolerance table).

Covered here: grouped value heads with K != V, wide heads (K = 144, V = 130: several K / V
tiles, a 6-token last chunk), varlen with an empty sequence, l2-normalised q / k or not, beta in
(0, 2), near 0 and near 1, no initial state, fp32 dg under gates in [-20, -1] and [-20, -10]
over several chunks, fp16 dh0 with every gate in [-20, -10], and output_final_state=False.
Interpreted on CPU (TRITON_INTERPRET=1, set by conftest or here) or on a GPU with
PARITY_DEVICE=cuda.
"""
from __future__ import annotations

import os

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import triton  # noqa: E402,F401  (the suite needs every framework: no silent skip)

from parity_tests import triton_interpret_patch  # noqa: E402
from parity_tests.harness import assert_passed, check, check_no_final_state  # noqa: E402

triton_interpret_patch.apply()

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"
ALL = ("fp32", "bf16", "fp16")
TRITON = {"torch": "triton"}


def _rows(op, *entries):
    """op, (case, dtypes)... -> pytest params (op, case, dtype)"""
    return [pytest.param(op, c, d, id=f"{op}-{c}-{d}") for c, dts in entries for d in dts]


ROWS = (
    _rows("chunk_gated_delta_rule",
          ("dr_gqa_kv", ALL), ("dr_varlen_l2", ("fp32",)), ("dr_strong_tiny_beta", ("fp32",)),
          ("dr_wide", ("fp32", "bf16")), ("dr_strong_long_beta1", ("fp32",)),
          ("dr_uniform_strong_long", ("fp32",)), ("dr_uniform_strong_k64", ("fp16",)))
    + _rows("fused_recurrent_gated_delta_rule",
            ("dr_gqa_kv_rec", ALL), ("dr_varlen_l2", ("fp32",)),
            ("dr_strong_tiny_beta", ("fp32",)), ("dr_strong_long_beta1", ("fp32",)))
    + _rows("chunk_delta_rule",
            ("dr_l2_beta2", ("fp32", "bf16")), ("dr_gqa_no_l2", ("bf16",)),
            ("dr_k24_beta1", ("fp16",)))
    + _rows("fused_recurrent_delta_rule",
            ("dr_l2_beta2_rec", ("fp32", "bf16")), ("dr_gqa_no_l2", ("bf16",)),
            ("dr_k24_beta1", ("fp16",)))
)


@pytest.mark.parametrize("op,case,dtype", ROWS)
def test_delta_triton(op, case, dtype):
    assert_passed(check(op, case, dtype, TRITON, device=DEVICE))


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_no_final_state(op):
    """output_final_state=False (gates to -20, beta < 1e-3, no h0): no final state, o and every
    gradient as the oracle's with a zero final-state cotangent."""
    assert_passed(check_no_final_state(op, "dr_strong_tiny_beta", "fp32", TRITON, device=DEVICE))


def test_chunk_varlen_reads_no_device_value_on_the_host(monkeypatch):
    """chunk_gated_delta_rule(impl='triton') with cu_seqlens, forward and backward, makes no
    host sync: no tensor is read back (.cpu(), .item(), .tolist(), .numpy()); the kernels find
    each chunk slot's sequence themselves (engine/varlen.py). Launches are recorded, not run."""
    import torch

    from fla_torch.ops.gated_delta_rule.triton_chunk import chunk_gated_delta_rule_triton
    from parity_tests.triton_compile_check import record_launches

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 300, 2, 32, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 300, 2, 32, generator=gen, requires_grad=True)
    g = (-torch.rand(1, 300, 2, generator=gen)).requires_grad_()
    beta = torch.rand(1, 300, 2, generator=gen).requires_grad_()
    cu = torch.tensor([0, 100, 100, 300], dtype=torch.int32)

    def forbidden(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name} during the op")
        return read

    with record_launches() as rec:
        for name in ("cpu", "item", "tolist", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, forbidden(name))
        o, ht = chunk_gated_delta_rule_triton(
            q, k, v, g=g, beta=beta, scale=0.2, initial_state=None, output_final_state=True,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
        (o.sum() + ht.sum()).backward()
        monkeypatch.undo()
    names = {r["name"] for r in rec}
    assert {"_wy_fwd16_kernel", "_chunk_h_kernel", "_chunk_o_kernel", "_dqk_kernel",
            "_wy_bwd2_kernel"} <= names, names


@pytest.mark.parametrize("K,dtype,warps", [(256, "bfloat16", 8), (256, "float16", 8),
                                           (256, "float32", 4), (128, "bfloat16", 4)])
def test_chunk_dh_launch_at_k256(K, dtype, warps):
    """chunk_dh at K = 256 in 16-bit runs 8 warps: with 4 the ungated delta rule's dh came out
    non-finite on the H100 (Triton 3.6; not reproducible in the interpreter)."""
    import torch

    from fla_torch.ops.common.engine.launch import delta_state_launch
    BK, _, kw = delta_state_launch("chunk_dh", K, 64, getattr(torch, dtype))
    assert BK == K and kw["num_warps"] == warps
