"""The tolerance table is tight enough to catch real bugs: deliberately broken variants of the
chunked implementations must fail the same checks the real ones pass."""
from __future__ import annotations

import importlib

import pytest

from .harness import check


def _wrap_torch(kind):
    import torch

    from fla_torch.ops.gated_delta_rule.chunked import gated_delta_rule_chunked as good

    class ScaleDk(torch.autograd.Function):
        @staticmethod
        def forward(ctx, k):
            return k.clone()

        @staticmethod
        def backward(ctx, dk):
            return dk * 1.03

    def bad(q, k, v, *, g, beta, scale, initial_state, **kw):
        if kind == "scale":
            scale = scale * 1.03
        elif kind == "gate_shift":
            g = torch.roll(g, 1, dims=1)
        elif kind == "drop_h0" and initial_state is not None:
            initial_state = initial_state.clone()
            initial_state[-1] = 0
        elif kind == "grad_k":
            k = ScaleDk.apply(k)
        return good(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state, **kw)
    return bad


def _wrap_jax(kind):
    import jax
    import jax.numpy as jnp

    from fla_jax.ops.gated_delta_rule.chunked import gated_delta_rule_chunked as good

    @jax.custom_vjp
    def scale_dk(k):
        return k

    scale_dk.defvjp(lambda k: (k, None), lambda _, dk: (dk * 1.03,))

    def bad(q, k, v, *, g, beta, scale, initial_state, **kw):
        if kind == "scale":
            scale = scale * 1.03
        elif kind == "gate_shift":
            g = jnp.roll(g, 1, axis=1)
        elif kind == "drop_h0" and initial_state is not None:
            initial_state = initial_state.at[-1].set(0)
        elif kind == "grad_k":
            k = scale_dk(k)
        return good(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state, **kw)
    return bad


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind,case,caught", [
    ("scale", "basic", "o"), ("gate_shift", "basic", "o"), ("drop_h0", "varlen", "o"),
    ("grad_k", "basic", "dk")])
def test_perturbed_chunked_is_caught(monkeypatch, framework, dtype, kind, case, caught):
    iface = importlib.import_module(f"fla_{framework}.ops.gated_delta_rule.interface")
    wrap = _wrap_torch if framework == "torch" else _wrap_jax
    op = "chunk_gated_delta_rule"
    honest = check(op, case, dtype, {framework: "chunked"})
    assert all(r.passed for r in honest)
    monkeypatch.setitem(iface.CHUNK_IMPLS, "chunked", wrap(kind))
    rows = check(op, case, dtype, {framework: "chunked"})
    failed = {r.tensor for r in rows if not r.passed}
    assert caught in failed, f"{kind} in {dtype} was not caught: {[(r.tensor, r.error) for r in rows]}"
