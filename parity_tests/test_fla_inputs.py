"""FLA 0.6's input transforms on chunk_kda / fused_recurrent_kda and the gated delta rule ops
(fla_contract/fla_inputs.py): use_gate_in_kernel with A_log / dt_bias / lower_bound, and
use_beta_sigmoid_in_kernel with allow_neg_eigval. Each call equals the op on the gate and beta
computed by hand (float64 formula, and FLA's own naive gate functions where FLA is installed),
gradients reach the raw g, A_log, dt_bias and beta, both frameworks agree, and every
inconsistent combination raises an error that names the argument."""
from __future__ import annotations

import numpy as np
import pytest
import torch

B, T, H, HV, K, V = 1, 20, 1, 2, 8, 8


def _raw(seed=0):
    rng = np.random.default_rng(seed)
    return dict(q=rng.standard_normal((B, T, H, K)), k=rng.standard_normal((B, T, H, K)) / 3,
                v=rng.standard_normal((B, T, HV, V)), g=rng.standard_normal((B, T, HV, K)),
                g_head=-rng.uniform(0.01, 0.5, (B, T, HV)), beta=rng.standard_normal((B, T, HV)),
                A_log=rng.uniform(-1, 1, (HV,)), dt_bias=rng.standard_normal((HV * K,)),
                do=rng.standard_normal((B, T, HV, V)))


def _gate(x, A_log=None, dt_bias=None, lower_bound=None):
    """The gate of fla_contract/fla_inputs.py, float64 numpy."""
    x = x + (0 if dt_bias is None else dt_bias.reshape(HV, K))
    a = None if A_log is None else np.exp(A_log).reshape(HV, 1)
    if lower_bound is None:
        return -a * np.log1p(np.exp(x))
    return lower_bound / (1 + np.exp(-(x if a is None else a * x)))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


GATES = [dict(A_log=True, dt_bias=True), dict(A_log=True),
         dict(A_log=True, dt_bias=True, lower_bound=-5.0), dict(dt_bias=True, lower_bound=-3.0)]


def _kw(x, gate, beta_neg=None):
    kw = {}
    if gate is not None:
        kw = dict(use_gate_in_kernel=True, lower_bound=gate.get("lower_bound"),
                  A_log=x["A_log"] if gate.get("A_log") else None,
                  dt_bias=x["dt_bias"] if gate.get("dt_bias") else None)
    if beta_neg is not None:
        kw.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=beta_neg)
    return kw


@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("gi", range(len(GATES)))
def test_kda_gate_and_beta_torch(op, gi):
    import fla_torch.ops as ops
    x = _raw(gi)
    t = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in x.items()}
    gate = GATES[gi]
    neg = gi % 2 == 1
    kw = _kw(t, gate, beta_neg=neg)
    fn = getattr(ops, op)
    o, ht = fn(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=None,
               output_final_state=True, impl="reference", **kw)
    g_ref = _gate(x["g"], x["A_log"] if gate.get("A_log") else None,
                  x["dt_bias"] if gate.get("dt_bias") else None, gate.get("lower_bound"))
    beta_ref = _sigmoid(x["beta"]) * (2 if neg else 1)
    o_ref, ht_ref = fn(*(torch.tensor(x[n]) for n in ("q", "k", "v")), torch.tensor(g_ref),
                       torch.tensor(beta_ref), output_final_state=True, impl="reference")
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-12, atol=1e-12)
    (o * torch.tensor(x["do"])).sum().backward()
    used = ["g", "beta"] + [n for n in ("A_log", "dt_bias") if gate.get(n)]
    for n in used:
        assert t[n].grad is not None and torch.isfinite(t[n].grad).all(), n
        assert t[n].grad.abs().max() > 0, n
    # the gradient of A_log by central differences of the loss
    if gate.get("A_log"):
        eps, i = 1e-6, 1

        def loss(a_log):
            kw2 = dict(kw, A_log=torch.tensor(a_log))
            o2, _ = fn(*(torch.tensor(x[n]) for n in ("q", "k", "v")), torch.tensor(x["g"]),
                       torch.tensor(x["beta"]), impl="reference", output_final_state=True, **kw2)
            return float((o2 * torch.tensor(x["do"])).sum().detach())
        a_hi, a_lo = x["A_log"].copy(), x["A_log"].copy()
        a_hi[i] += eps
        a_lo[i] -= eps
        fd = (loss(a_hi) - loss(a_lo)) / (2 * eps)
        assert abs(float(t["A_log"].grad[i]) - fd) <= 1e-6 * max(1.0, abs(fd)), (fd,)


def test_kda_gate_matches_fla_naive():
    naive = pytest.importorskip(
        "fla.ops.kda.gate", reason="optional comparison against FLA itself: fla-core is not "
        "installed; pip install -e '.[test]' installs it")
    from fla_torch.ops.common.fla_inputs import apply_transforms
    x = _raw(3)
    g, A, dt = (torch.tensor(x[n], dtype=torch.float32) for n in ("g", "A_log", "dt_bias"))
    ours, _ = apply_transforms("chunk_kda", g, None, use_gate_in_kernel=True, A_log=A,
                               dt_bias=dt)
    torch.testing.assert_close(ours, naive.naive_kda_gate(g, A, dt), rtol=1e-6, atol=1e-6)
    for a in (A, None):
        ours, _ = apply_transforms("chunk_kda", g, None, use_gate_in_kernel=True, A_log=a,
                                   dt_bias=dt, lower_bound=-5.0)
        theirs = naive.naive_kda_lowerbound_gate(g, a, dt, lower_bound=-5.0)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_gdn_beta_logits_torch(op):
    import fla_torch.ops as ops
    x = _raw(5)
    fn = getattr(ops, op)
    args = [torch.tensor(x[n]) for n in ("q", "k", "v", "g_head")]
    for neg in (False, True):
        o, _ = fn(*args, torch.tensor(x["beta"]), use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=neg, impl="reference")
        o_ref, _ = fn(*args, torch.tensor(_sigmoid(x["beta"]) * (2 if neg else 1)),
                      impl="reference")
        torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op,gi", [("chunk_kda", 0), ("chunk_kda", 2),
                                   ("fused_recurrent_kda", 3), ("chunk_gated_delta_rule", None)])
def test_jax_matches_torch_with_transforms(op, gi):
    """JAX (float32) against torch (float64): outputs and the gradients of the raw inputs."""
    import jax
    import jax.numpy as jnp

    import fla_jax.ops as jops
    import fla_torch.ops as tops
    x = _raw(7)
    gate = None if gi is None else GATES[gi]
    g_name = "g" if "kda" in op else "g_head"
    names = ["g", "beta"] + ([n for n in ("A_log", "dt_bias") if gate.get(n)] if gate else [])

    def jloss(gv, bv, *ad):
        kw = _kw(dict(zip(names[2:], ad)), gate, beta_neg=True)
        o, _ = getattr(jops, op)(*(jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v")),
                                 gv, bv, impl="reference", **kw)
        return jnp.sum(o * jnp.asarray(x["do"], jnp.float32)), o
    jin = [jnp.asarray(x[g_name], jnp.float32), jnp.asarray(x["beta"], jnp.float32)] + \
        [jnp.asarray(x[n], jnp.float32) for n in names[2:]]
    (_, o_j), grads_j = jax.value_and_grad(jloss, argnums=tuple(range(len(jin))),
                                           has_aux=True)(*jin)
    t = {n: torch.tensor(x[g_name if n == "g" else n], requires_grad=True) for n in names}
    kw = _kw(t, gate, beta_neg=True)
    o_t, _ = getattr(tops, op)(*(torch.tensor(x[n]) for n in ("q", "k", "v")), t["g"],
                               t["beta"], impl="reference", **kw)
    (o_t * torch.tensor(x["do"])).sum().backward()
    np.testing.assert_allclose(np.asarray(o_j), o_t.detach().numpy(), rtol=2e-5, atol=2e-5)
    for n, gj in zip(names, grads_j):
        gt = t[n].grad.numpy()
        err = np.sqrt(np.mean((np.asarray(gj, np.float64) - gt) ** 2)) / np.sqrt(np.mean(gt ** 2))
        assert err <= 1e-5, (n, err)


def _errors():
    """(kwargs, exception, words) for each inconsistent combination (KDA)."""
    x = _raw(9)
    return [
        (dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval=True without "
                                                  "use_beta_sigmoid_in_kernel=True"),
        (dict(A_log=x["A_log"]), ValueError, "A_log given with use_gate_in_kernel=False"),
        (dict(lower_bound=-5.0), ValueError, "lower_bound given with use_gate_in_kernel=False"),
        (dict(use_gate_in_kernel=True), ValueError, "use_gate_in_kernel=True needs A_log ([2]"),
        (dict(use_gate_in_kernel=True, A_log=x["A_log"][:1]), ValueError,
         "A_log has shape [1]; expected [2] (HV=2, K=8 from g)"),
        (dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"][:8]), ValueError,
         "dt_bias has shape [8]; expected [16] or [2, 8]"),
        (dict(use_gate_in_kernel=True, A_log=x["A_log"].astype(np.int32)), TypeError,
         "A_log has dtype int32; expected a float tensor"),
        (dict(use_gate_in_kernel=True, lower_bound=0.5), ValueError,
         "lower_bound=0.5; expected a finite negative number"),
        (dict(use_gate_in_kernel=True, lower_bound=True), ValueError,
         "lower_bound=True; expected a finite negative number"),
        (dict(use_gate_in_kernel=1, A_log=x["A_log"]), TypeError,
         "use_gate_in_kernel=1; expected True or False"),
    ]


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_inconsistent_transforms_are_named(framework):
    x = _raw(9)
    if framework == "torch":
        import fla_torch.ops as ops
        conv = torch.tensor
    else:
        import jax.numpy as jnp

        import fla_jax.ops as ops
        conv = jnp.asarray
    args = [conv(x[n]) for n in ("q", "k", "v", "g", "beta")]
    for kw, exc, words in _errors():
        kw = {n: conv(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
        with pytest.raises(exc) as info:
            ops.chunk_kda(*args, impl="reference", **kw)
        assert str(info.value).startswith("chunk_kda: ") and words in str(info.value), (
            kw, str(info.value))
    with pytest.raises(TypeError):   # the delta rules have no gate transform
        ops.chunk_gated_delta_rule(*[conv(x[n]) for n in ("q", "k", "v", "g_head", "beta")],
                                   use_gate_in_kernel=True, impl="reference")
