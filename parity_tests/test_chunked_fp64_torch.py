"""fla_torch: impl='chunked' == impl='reference' in float64, outputs, final states and gradients.

Both implementations run in float64 on the same random inputs; every tensor (o, final_state,
and the gradients of q, k, v, g, beta, g_gamma, initial_state under random cotangents) must
agree to RMS(chunked - reference) / RMS(reference) < 1e-9. A perturbed implementation
(scale * 1.001) must fail that check. Tiny shapes: the whole file runs in well under a
minute on one core.
"""
from __future__ import annotations

import math

import pytest
import torch

from fla_torch import ops

TOL = 1e-9
F64 = torch.float64

OPS = {
    "simple_gla": ops.chunk_simple_gla,
    "gla": ops.chunk_gla,
    "delta_rule": ops.chunk_delta_rule,
    "gated_delta_rule": ops.chunk_gated_delta_rule,
}
RECURRENT_OPS = {
    "simple_gla": ops.fused_recurrent_simple_gla,
    "gla": ops.fused_recurrent_gla,
    "delta_rule": ops.fused_recurrent_delta_rule,
    "gated_delta_rule": ops.fused_recurrent_gated_delta_rule,
}
DELTA = ("delta_rule", "gated_delta_rule")


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(a - ref) / RMS(ref) (absolute RMS when ref is all zeros)."""
    a, ref = a.detach().to(F64), ref.detach().to(F64)
    err = (a - ref).pow(2).mean().sqrt().item()
    scale = ref.pow(2).mean().sqrt().item()
    return err / scale if scale > 0 else err


def make_inputs(family, *, T=100, B=1, H=2, HV=None, K=32, V=48, cu_seqlens=None,
                gate=1.0, gate_kind="g", beta_max=1.0, l2norm=False, h0=True, seed=0,
                dtype=F64):
    """Random inputs (never zeros) for one call; returns (args, kwargs, grad names)."""
    gen = torch.Generator().manual_seed(seed)
    HV = H if HV is None else HV
    rand = lambda *s: torch.rand(*s, generator=gen, dtype=F64)  # noqa: E731
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q = randn(B, T, H, K)
    k = randn(B, T, H, K)
    if family in DELTA and not l2norm:
        # rows of norm in (0.3, 1): the delta rule stays contractive for beta in (0, 2)
        k = k / k.norm(dim=-1, keepdim=True) * (0.3 + 0.7 * rand(B, T, H, 1))
    elif family not in DELTA:
        k = k / math.sqrt(K)
    v = randn(B, T, HV, V)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    t = {"q": q, "k": k, "v": v}
    # per-token log-decay of strength ~gate: uniform in (-1.5 gate, -0.5 gate)
    if family == "gla":
        t["g"] = -gate * (0.5 + rand(B, T, HV, K))
    elif family == "gated_delta_rule" or (family == "simple_gla" and "g" in gate_kind):
        t["g"] = -gate * (0.5 + rand(B, T, HV))
    if family == "simple_gla" and "gamma" in gate_kind:
        t["g_gamma"] = -gate * (0.5 + rand(HV))
    if family in DELTA:
        t["beta"] = beta_max * (0.02 + 0.96 * rand(B, T, HV))
    if h0:
        t["initial_state"] = randn(N, HV, K, V).to(F64 if dtype == F64 else torch.float32)
    t = {name: x.to(dtype) if name in ("q", "k", "v") else x for name, x in t.items()}
    kwargs = {name: x for name, x in t.items() if name not in ("q", "k", "v")}
    kwargs["output_final_state"] = True
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int64)
    if family in DELTA:
        kwargs["use_qk_l2norm_in_kernel"] = l2norm
    return t, kwargs


def run_with_grads(family, impl, tensors, kwargs, cotangent_seed=1, scale=None, op=None):
    """Run one impl; returns {name: tensor} for o, final_state and every input gradient."""
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in tensors.items()}
    kw = dict(kwargs)
    kw.update({n: x for n, x in leaves.items() if n not in ("q", "k", "v")})
    if scale is not None:
        kw["scale"] = scale
    fn = op or OPS[family]
    o, s = fn(leaves["q"], leaves["k"], leaves["v"], impl=impl, **kw)
    gen = torch.Generator().manual_seed(cotangent_seed)
    do = torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype)
    ds = torch.randn(s.shape, generator=gen, dtype=F64).to(s.dtype)
    loss = (o * do).sum() + (s * ds).sum()
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    out = {"o": o, "final_state": s}
    out.update({f"d{n}": g for n, g in zip(names, grads)})
    return out


def compare(family, tensors, kwargs, **perturb):
    ref = run_with_grads(family, "reference", tensors, kwargs)
    scale = perturb.get("scale")
    got = run_with_grads(family, "chunked", tensors, kwargs, scale=scale)
    assert set(ref) == set(got)
    return {name: rel_rms(got[name], ref[name]) for name in ref}, ref, got


# (id, family, make_inputs kwargs)
CASES = []
for fam in OPS:
    extra = {"HV": 4} if fam in DELTA else {}
    for T in (1, 63, 64, 100, 130):
        CASES.append((f"{fam}-T{T}", fam, dict(T=T, B=2, **extra)))
    CASES.append((f"{fam}-varlen", fam, dict(T=300, cu_seqlens=[0, 15, 100, 300], **extra)))
    CASES.append((f"{fam}-varlen-empty", fam,
                  dict(T=140, cu_seqlens=[0, 70, 70, 140, 140], **extra)))
    CASES.append((f"{fam}-no-h0", fam, dict(T=100, B=2, h0=False, **extra)))
    CASES.append((f"{fam}-weak", fam, dict(T=130, gate=0.01, **extra)))
    CASES.append((f"{fam}-strong", fam, dict(T=130, gate=10.0, **extra)))
    CASES.append((f"{fam}-K48-V32", fam, dict(T=70, K=48, V=32, **extra)))
CASES += [
    ("simple_gla-gamma", "simple_gla", dict(T=100, gate_kind="gamma")),
    ("simple_gla-g+gamma", "simple_gla", dict(T=100, gate_kind="g+gamma", gate=0.5)),
    ("simple_gla-nogate", "simple_gla", dict(T=100, gate_kind="")),
    ("simple_gla-strong-gamma", "simple_gla", dict(T=100, gate_kind="gamma", gate=10.0)),
]
for fam in DELTA:
    CASES += [
        (f"{fam}-l2norm", fam, dict(T=130, HV=4, l2norm=True)),
        (f"{fam}-beta2", fam, dict(T=130, HV=4, beta_max=2.0)),
        (f"{fam}-l2norm-beta2-varlen", fam,
         dict(T=300, HV=4, l2norm=True, beta_max=2.0, cu_seqlens=[0, 15, 100, 300])),
        (f"{fam}-mha", fam, dict(T=100, HV=2)),
        (f"{fam}-gqa-H1", fam, dict(T=65, H=1, HV=3)),
    ]


@pytest.mark.parametrize("family,params", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_chunked_matches_reference_fp64(family, params):
    tensors, kwargs = make_inputs(family, **params)
    errs, ref, got = compare(family, tensors, kwargs)
    for name, x in got.items():
        assert x.dtype == ref[name].dtype == F64, (name, x.dtype, ref[name].dtype)
        assert x.shape == ref[name].shape, (name, x.shape, ref[name].shape)
        assert torch.isfinite(x).all(), name
    bad = {n: e for n, e in errs.items() if not e < TOL}
    assert not bad, f"chunked vs reference rel RMS above {TOL}: {bad}"
    expected = {"o", "final_state", "dq", "dk", "dv"} | {f"d{n}" for n in tensors
                                                          if n not in ("q", "k", "v")}
    assert set(errs) == expected


CHUNKED_FNS = {
    "simple_gla": "fla_torch.ops.simple_gla.chunked:simple_gla_chunked",
    "gla": "fla_torch.ops.gla.chunked:gla_chunked",
    "delta_rule": "fla_torch.ops.gated_delta_rule.chunked:delta_chunked",
    "gated_delta_rule": "fla_torch.ops.gated_delta_rule.chunked:delta_chunked",
}


@pytest.mark.parametrize("family", list(OPS))
@pytest.mark.parametrize("chunk_size", [8, 32])
def test_chunk_size_does_not_change_results(family, chunk_size):
    """Other chunk sizes (other packing / alignment of the varlen sequences) give the same
    results as the reference."""
    import importlib
    module, _, name = CHUNKED_FNS[family].partition(":")
    fn = getattr(importlib.import_module(module), name)
    tensors, kwargs = make_inputs(family, T=90, HV=4 if family in DELTA else None,
                                  cu_seqlens=[0, 7, 40, 40, 90], l2norm=family in DELTA)
    K = tensors["q"].shape[-1]

    def op(q, k, v, impl, **kw):
        assert impl == "chunked"
        if family == "delta_rule":
            kw["g"] = None
        if family in DELTA:
            return fn(q, k, v, kw.pop("g"), kw.pop("beta"), K ** -0.5, kw["initial_state"],
                      True, kw["cu_seqlens"], kw["use_qk_l2norm_in_kernel"],
                      chunk_size=chunk_size)
        return fn(q, k, v, scale=K ** -0.5, chunk_size=chunk_size, **kw)

    ref = run_with_grads(family, "reference", tensors, kwargs)
    got = run_with_grads(family, "chunked", tensors, kwargs, op=op)
    errs = {n: rel_rms(got[n], ref[n]) for n in ref}
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("family", list(OPS))
def test_perturbed_scale_is_caught(family):
    """A chunked run with scale * 1.001 must fail the tolerance on o and on dq, dk."""
    tensors, kwargs = make_inputs(family, T=70, HV=4 if family in DELTA else None)
    K = tensors["q"].shape[-1]
    errs, _, _ = compare(family, tensors, kwargs, scale=K ** -0.5 * 1.001)
    for name in ("o", "dq", "dk"):
        assert errs[name] > 100 * TOL, (name, errs[name])


@pytest.mark.parametrize("family", list(OPS))
def test_recurrent_entry_points_agree(family):
    """fused_recurrent_* and chunk_* reach the same implementations."""
    tensors, kwargs = make_inputs(family, T=40, HV=4 if family in DELTA else None)
    for impl in ("reference", "chunked"):
        a = run_with_grads(family, impl, tensors, kwargs)
        b = run_with_grads(family, impl, tensors, kwargs, op=RECURRENT_OPS[family])
        for name in a:
            assert rel_rms(b[name], a[name]) == 0.0, (impl, name)


@pytest.mark.parametrize("family", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_dtypes_and_strong_gates(family, dtype):
    """Low-precision inputs: o in q's dtype, state fp32, grads in input dtypes, all finite
    with per-token log-decays down to -20; fp32 close to the fp64 reference."""
    tensors, kwargs = make_inputs(family, T=130, HV=4 if family in DELTA else None, gate=13.0,
                                  dtype=dtype)
    if "g" in tensors:
        assert tensors["g"].min() < -19.0
    out = run_with_grads(family, "chunked", tensors, kwargs)
    assert out["o"].dtype == dtype
    assert out["final_state"].dtype == torch.float32
    for name, x in tensors.items():
        assert out[f"d{name}"].dtype == x.dtype, name
    for name, x in out.items():
        assert torch.isfinite(x).all(), name
    if dtype == torch.float32:
        t64 = {n: x.to(F64) for n, x in tensors.items()}
        k64 = dict(kwargs)
        k64.update({n: x for n, x in t64.items() if n not in ("q", "k", "v")})
        ref = run_with_grads(family, "reference", t64, k64)
        for name in ref:
            assert rel_rms(out[name], ref[name]) < 1e-5, name


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
    x = torch.randn(1, 4, 2, 8)
    g = -torch.rand(1, 4, 2)
    b = torch.rand(1, 4, 2)
    with pytest.raises(TypeError, match=rf"\b{missing} is None"):
        call(x, g, b)
