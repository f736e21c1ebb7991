"""fla_torch: impl='chunked' == the float64 oracle (impl='reference') in float64, outputs, final
states and every gradient, as a case list on the shared harness (cases.FP64_CASES,
harness.check, TOLERANCE['fp64'] = 1e-9), so that the chunked path can stand in for the token
loop as the GPU's float64 oracle.

Families: simple_gla, gla, delta_rule, gated_delta_rule, kda, rwkv7. Also: other chunk sizes,
fused_recurrent_* reaching the same implementations, a perturbed scale caught, fp32 / bf16 with
per-token gates down to -19.5, and missing required arguments named. Tiny shapes: the file runs
in seconds.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import pytest
import torch

from fla_torch import ops

from . import torch_runner
from .cases import CASES, FP64_CASES, OPS, rel_rms, tolerance
from .harness import assert_passed, check, inputs, oracle

CHUNKED = {"torch": "chunked"}
FAMILIES = ("simple_gla", "gla", "delta_rule", "gated_delta_rule", "kda", "rwkv7")
F64_ROWS = [pytest.param(f"chunk_{f}", c.name, id=f"{f}-{c.name}") for c in FP64_CASES
            if "fp64" in c.dtypes for f in FAMILIES
            if c.applies_to(OPS[f"chunk_{f}"]) and "chunks" not in c.name]


def _pair(family: str, name: str) -> str:
    """A _fp64_pair case for the family: f64_<name>, or f64_<name>_gqa for the delta rules."""
    return f"{name}_gqa" if family in ("delta_rule", "gated_delta_rule") else name


@pytest.mark.parametrize("op,case", F64_ROWS)
def test_chunked_matches_reference_fp64(op, case):
    assert_passed(check(op, case, "fp64", CHUNKED))


@pytest.fixture
def chunk_size(monkeypatch, request):
    """The chunked implementations run with chunk size request.param."""
    cs = request.param
    for module, name in (("simple_gla.chunked", "simple_gla_chunked"),
                         ("gla.chunked", "gla_chunked"),
                         ("gated_delta_rule.chunked", "delta_chunked"),
                         ("delta_rule.chunked", "delta_chunked")):
        mod = importlib.import_module(f"fla_torch.ops.{module}")
        monkeypatch.setattr(mod, name, functools.partial(getattr(mod, name), chunk_size=cs))
    return cs


@pytest.mark.parametrize("chunk_size", [8, 32], indirect=True)
@pytest.mark.parametrize("family", FAMILIES[:4])
def test_chunk_size_does_not_change_results(family, chunk_size):
    """Other chunk sizes (other packing / alignment of the varlen sequences) give the same
    results as the reference."""
    assert_passed(check(f"chunk_{family}", _pair(family, "f64_varlen_chunks"), "fp64", CHUNKED))


@pytest.mark.parametrize("family", FAMILIES)
def test_perturbed_scale_is_caught(family):
    """A chunked run with scale * 1.001 fails the fp64 tolerance on o and the query / key
    gradients."""
    op = f"chunk_{family}"
    case = _pair(family, "f64_k48_v32") if family in FAMILIES[:4] else "f64_dplr_basic"
    c = CASES[case]
    bad = dataclasses.replace(c, scale=1.001 * c.K ** -0.5)
    ref = oracle(op, case, "fp64")
    got = torch_runner.run(OPS[op], bad, "chunked", "fp64", inputs(op, case, "fp64"))
    for t in ("o", "dr" if family == "rwkv7" else "dq", "dk"):
        assert rel_rms(got[t], ref[t], ref[t]) > 100 * tolerance("fp64", t), t


@pytest.mark.parametrize("family", FAMILIES)
def test_recurrent_entry_points_agree(family):
    """fused_recurrent_* and chunk_* reach the same implementations: equal to the bit."""
    case = _pair(family, "f64_k48_v32") if family in FAMILIES[:4] else "f64_dplr_basic"
    for impl in ("reference", "chunked"):
        a, b = (torch_runner.run(OPS[f"{v}_{family}"], CASES[case], impl, "fp64",
                                 inputs(f"chunk_{family}", case, "fp64"))
                for v in ("chunk", "fused_recurrent"))
        for t in a:
            assert rel_rms(b[t], a[t], a[t]) == 0.0, (impl, t)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES[:4])
def test_chunked_dtypes_and_strong_gates(family, dtype):
    """fp32 / bf16 inputs with per-token log-decays down to -19.5: the dtype contract (checked
    by the runner) and parity; fp32 is held to 1e-5 on every tensor (dg and dbeta included)."""
    rows = check(f"chunk_{family}", _pair(family, "chunked_strong13"), dtype, CHUNKED)
    if dtype == "fp32":
        for r in rows:
            r.tolerance = min(r.tolerance, 1e-5)
    assert_passed(rows)


@pytest.mark.parametrize("call,missing", [
    (lambda x, g, b: ops.chunk_gla(x, x, x, None), "g"),
    (lambda x, g, b: ops.fused_recurrent_gla(x, x, x, None), "g"),
    (lambda x, g, b: ops.chunk_delta_rule(x, x, x, None), "beta"),
    (lambda x, g, b: ops.fused_recurrent_delta_rule(x, x, x, None), "beta"),
    (lambda x, g, b: ops.chunk_gated_delta_rule(x, x, x, None, b), "g"),
    (lambda x, g, b: ops.chunk_gated_delta_rule(x, x, x, g, None), "beta"),
    (lambda x, g, b: ops.fused_recurrent_gated_delta_rule(x, x, x, g, None), "beta"),
])
def test_missing_required_argument_is_named(call, missing):
    x = torch.ones(1, 4, 2, 8)
    g = -torch.ones(1, 4, 2)
    b = torch.ones(1, 4, 2)
    with pytest.raises(TypeError, match=rf"\b{missing} is None"):
        call(x, g, b)
