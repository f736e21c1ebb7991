"""fla_torch KDA and RWKV-7: impl='chunked' == impl='reference' in float64 (outputs, final
states and every gradient under random cotangents, RMS(chunked - reference) / RMS(reference)
< 1e-9), so the chunked path can stand in for the token loop as the GPU's float64 oracle.
A perturbed call (scale * 1.001) must fail the check. Tiny shapes, well under a minute.
"""
from __future__ import annotations

import pytest
import torch

from fla_torch import ops

TOL = 1e-9
F64 = torch.float64


def _rel(a, ref):
    err = (a - ref).pow(2).mean().sqrt().item()
    s = ref.pow(2).mean().sqrt().item()
    return err / s if s > 0 else err


def _inputs(family, T, cu, strength, H, HV, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    B = 1 if cu else 2
    N = len(cu) - 1 if cu else B
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    gate = -strength * (0.05 + 0.95 * torch.rand(B, T, HV, K, generator=g, dtype=F64))
    if family == "kda":
        k = rnd(B, T, H, K)
        x = dict(q=rnd(B, T, H, K), k=k / k.norm(dim=-1, keepdim=True), v=rnd(B, T, HV, V),
                 g=gate, beta=torch.rand(B, T, HV, generator=g, dtype=F64))
    else:
        kk = rnd(B, T, H, K)
        kk = kk / kk.norm(dim=-1, keepdim=True)
        x = dict(r=rnd(B, T, H, K), w=gate, k=rnd(B, T, H, K) / K ** 0.5, v=rnd(B, T, H, V),
                 a=-kk, b=kk * torch.rand(B, T, H, K, generator=g, dtype=F64))
    x["initial_state"] = 0.5 * rnd(N, HV, K, V)
    return x, (torch.tensor(cu, dtype=torch.int32) if cu else None)


def _run(fn, x, cu, impl, scale=None, **kw):
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = fn(**leaves, scale=scale, output_final_state=True, cu_seqlens=cu, impl=impl, **kw)
    g = torch.Generator().manual_seed(7)
    cots = [torch.randn(o.shape, generator=g, dtype=F64), torch.randn(ht.shape, generator=g,
                                                                        dtype=F64)]
    grads = torch.autograd.grad([o, ht], list(leaves.values()), cots)
    return [o, ht] + list(grads)


CASES = [
    ("kda_basic", "kda", dict(T=100, cu=None, strength=1.0, H=2, HV=2, K=32, V=48), {}),
    ("kda_varlen_strong_gqa_l2", "kda",
     dict(T=90, cu=(0, 5, 20, 20, 90), strength=20.0, H=1, HV=2, K=16, V=24),
     dict(use_qk_l2norm_in_kernel=True)),
    ("rwkv7_basic", "rwkv7", dict(T=100, cu=None, strength=1.0, H=2, HV=2, K=32, V=48), {}),
    ("rwkv7_varlen_strong", "rwkv7",
     dict(T=90, cu=(0, 5, 20, 20, 90), strength=20.0, H=2, HV=2, K=16, V=24), {}),
]


@pytest.mark.parametrize("family,shape,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_chunked_matches_reference_fp64(family, shape, kw):
    fn = getattr(ops, f"chunk_{family}")
    x, cu = _inputs(family, seed=1, **shape)
    ref = _run(fn, x, cu, "reference", **kw)
    got = _run(fn, x, cu, "chunked", **kw)
    errs = [_rel(a, b) for a, b in zip(got, ref)]
    assert max(errs) < TOL, errs
    bad = _run(fn, x, cu, "chunked", scale=1.001 * shape["K"] ** -0.5, **kw)
    assert _rel(bad[0], ref[0]) > TOL
