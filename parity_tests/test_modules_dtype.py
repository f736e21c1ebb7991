"""Two dtype incidents reproduced on the layers and modules, in both frameworks.

Incident 1: fp32 parameters with fp16 activations (and, in torch, under autocast): forward and
backward run, nothing is promoted, and the q, k, v reaching the op share the activation dtype.
Incident 3: log-decays / gates / beta reach the op in float32, computed in float32 (their values
match a float64 recomputation to fp32 rounding) under autocast and a bf16 policy / dtype.
A spy wrapped around each public op records what the layer hands it.
"""
from __future__ import annotations

import numpy as np
import pytest

from .cases import rel_rms
from .layer_runners import CASES_BY_NAME, draw, make_jax_layer, make_torch_layer

import torch  # noqa: E402  (the suite needs every framework: no silent skip)
import jax  # noqa: E402  (the suite needs every framework: no silent skip)
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import fla_jax.ops as jops  # noqa: E402
import fla_torch.ops as tops  # noqa: E402
from fla_torch import interop as tinterop  # noqa: E402

LAYERS = ("gdn", "deltanet", "gla", "retention", "linear_attn")
OP_NAMES = [f"{mode}_{fam}" for mode in ("chunk", "fused_recurrent")
            for fam in ("simple_gla", "gla", "delta_rule", "gated_delta_rule")]
GATE_ARGS = ("g", "beta", "g_gamma")


@pytest.fixture
def torch_spy(monkeypatch):
    calls = []
    for name in OP_NAMES:
        original = getattr(tops, name)

        def spy(q, k, v, *args, _orig=original, _name=name, **kwargs):
            calls.append({"op": _name, "q": q, "k": k, "v": v,
                          **{a: kwargs.get(a) for a in GATE_ARGS}})
            return _orig(q, k, v, *args, **kwargs)
        monkeypatch.setattr(tops, name, spy)
    return calls


@pytest.fixture
def jax_spy(monkeypatch):
    calls = []
    for name in OP_NAMES:
        original = getattr(jops, name)

        def spy(q, k, v, *args, _orig=original, _name=name, **kwargs):
            calls.append({"op": _name, "q": q, "k": k, "v": v,
                          **{a: kwargs.get(a) for a in GATE_ARGS}})
            return _orig(q, k, v, *args, **kwargs)
        monkeypatch.setattr(jops, name, spy)
    return calls


def _check_call(call, activation_dtype, gate_dtype):
    dts = {n: call[n].dtype for n in ("q", "k", "v")}
    assert all(d == activation_dtype for d in dts.values()), f"{call['op']}: q/k/v {dts}"
    for a in GATE_ARGS:
        if call[a] is not None:
            assert call[a].dtype == gate_dtype, f"{call['op']}: {a} is {call[a].dtype}"


# ----------------------------------------------------------------------------- torch

@pytest.mark.parametrize("name", LAYERS)
def test_torch_fp16_activations_fp32_params(name, torch_spy):
    """Incident 1: fp32 parameters, fp16 input, no autocast."""
    case = CASES_BY_NAME[name]
    layer = make_torch_layer(case)
    x, dy = draw(case)
    xt = torch.tensor(x, dtype=torch.float16, requires_grad=True)
    o, _, _ = layer(xt)
    o.backward(torch.tensor(dy, dtype=torch.float16))
    assert o.dtype == torch.float16 and xt.grad.dtype == torch.float16
    assert torch.isfinite(o).all() and torch.isfinite(xt.grad).all()
    for pname, p in layer.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, pname
        assert torch.isfinite(p.grad).all(), pname
    assert torch_spy
    for call in torch_spy:
        _check_call(call, torch.float16, torch.float32)


@pytest.mark.parametrize("ac", ["bf16", "fp16"])
@pytest.mark.parametrize("name", LAYERS)
def test_torch_autocast(name, ac, torch_spy):
    """Incident 1 under torch.autocast: fp32 parameters and input; q/k/v reach the op in the
    autocast dtype, gates in fp32; backward runs; parameter grads are fp32."""
    ad = {"bf16": torch.bfloat16, "fp16": torch.float16}[ac]
    case = CASES_BY_NAME[name]
    layer = make_torch_layer(case)
    x, dy = draw(case)
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=ad):
        o, _, _ = layer(xt)
    o.float().backward(torch.tensor(dy, dtype=torch.float32))
    assert o.dtype == ad and xt.grad.dtype == torch.float32
    assert torch.isfinite(xt.grad).all()
    for pname, p in layer.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), pname
    assert torch_spy
    for call in torch_spy:
        _check_call(call, ad, torch.float32)


def _expected_gates(name: str, sd: dict, x_seen: np.ndarray) -> dict:
    """float64 recomputation of the gates the layer should hand the op."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    x = np.asarray(x_seen, np.float64)
    if name == "gdn":
        a = x @ sd["a_proj.weight"].T
        sp = np.logaddexp(0.0, a + sd["dt_bias"])
        g = -np.exp(sd["A_log"]) * sp
        beta = 1.0 / (1.0 + np.exp(-(x @ sd["b_proj.weight"].T)))
        return {"g": g, "beta": beta}
    if name == "gla":
        case = CASES_BY_NAME[name].kwargs
        h = (x @ sd["gk_proj.0.weight"].T) @ sd["gk_proj.1.weight"].T + sd["gk_proj.1.bias"]
        gk = -np.logaddexp(0.0, -h) / 16.0
        groups = case["num_heads"] // case["num_kv_heads"]
        B, T, _ = gk.shape
        K = int(case["hidden_size"] * 0.5) // case["num_heads"]
        gk = np.repeat(gk.reshape(B, T, -1, K), groups, axis=2)
        return {"g": gk}
    if name == "deltanet":
        return {"beta": 1.0 / (1.0 + np.exp(-(x @ sd["b_proj.weight"].T)))}
    raise KeyError(name)


@pytest.mark.parametrize("name", ["gdn", "gla", "deltanet"])
@pytest.mark.parametrize("how", ["autocast", "policy"])
def test_torch_gates_fp32(name, how, torch_spy):
    """Incident 3: decays and beta are computed in fp32 under autocast(bf16) and under a bf16
    policy (bf16 parameters): their values equal a float64 recomputation to fp32 rounding
    (a bf16 computation would be off by ~1e-3 relative)."""
    case = CASES_BY_NAME[name]
    if how == "policy":
        import fla_torch.layers as tlayers
        torch.manual_seed(0)
        layer = getattr(tlayers, case.cls)(**case.kwargs, policy="bf16")
        assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    else:
        layer = make_torch_layer(case)
    x, _ = draw(case)
    xt = torch.tensor(x, dtype=torch.float32)
    with torch.no_grad():
        if how == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                o, _, _ = layer(xt)
        else:
            o, _, _ = layer(xt)
    assert o.dtype == torch.bfloat16
    x_seen = xt.to(torch.bfloat16).double().numpy()
    expected = _expected_gates(name, tinterop.to_numpy(layer), x_seen)
    (call,) = torch_spy
    _check_call(call, torch.bfloat16, torch.float32)
    for arg, ref in expected.items():
        got = call[arg].double().numpy()
        assert rel_rms(got, ref, ref) <= 1e-5, f"{arg}: {rel_rms(got, ref, ref):.2e}"


def test_torch_policy_string(torch_spy):
    """policy='params=fp32,compute=bf16,output=fp32': fp32 storage, bf16 compute, fp32 out."""
    import fla_torch.layers as tlayers
    case = CASES_BY_NAME["gdn"]
    layer = tlayers.GatedDeltaNet(**case.kwargs, policy="params=fp32,compute=bf16,output=fp32")
    assert all(p.dtype == torch.float32 for p in layer.parameters())
    x, _ = draw(case)
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    o, _, _ = layer(xt)
    o.sum().backward()
    assert o.dtype == torch.float32 and xt.grad.dtype == torch.float32
    for call in torch_spy:
        _check_call(call, torch.bfloat16, torch.float32)


def test_torch_modules_keep_activation_dtype():
    from fla_torch.modules import FusedRMSNormGated, RMSNorm, ShortConvolution
    x = torch.randn(2, 9, 16, dtype=torch.float16, requires_grad=True)
    conv = ShortConvolution(16, 4, bias=True)
    y, cache = conv(x, output_final_state=True)
    assert y.dtype == torch.float16 and cache.dtype == torch.float16
    assert RMSNorm(16)(x).dtype == torch.float16
    assert FusedRMSNormGated(16)(x, x).dtype == torch.float16
    (y.float().sum() + RMSNorm(16)(x).float().sum()).backward()
    assert x.grad.dtype == torch.float16 and conv.weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = conv(x.detach().float())
    assert y.dtype == torch.bfloat16


def test_torch_bad_policy_is_named():
    import fla_torch.layers as tlayers
    with pytest.raises(ValueError, match="policy"):
        tlayers.GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2, policy="params=fp33")
    with pytest.raises(TypeError, match="policy"):
        tlayers.GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2, policy=3)


# ----------------------------------------------------------------------------- jax

@pytest.mark.parametrize("name", LAYERS)
def test_jax_fp16_activations_fp32_params(name, jax_spy):
    """Incident 1 in Flax: param_dtype float32, dtype None, fp16 input: nothing promoted."""
    case = CASES_BY_NAME[name]
    layer = make_jax_layer(case, tinterop.to_numpy(make_torch_layer(case)))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    x, dy = draw(case)
    xj = jnp.asarray(x, jnp.float16)

    def loss(params, xj):
        o, _, _ = nnx.merge(graphdef, params, rest)(xj)
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(dy, jnp.float32)), o

    (_, o), (dparams, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, xj)
    assert o.dtype == jnp.float16 and dx.dtype == jnp.float16
    assert bool(jnp.isfinite(o.astype(jnp.float32)).all())
    for path, leaf in jax.tree_util.tree_leaves_with_path(dparams):
        assert leaf.dtype == jnp.float32 and bool(jnp.isfinite(leaf).all()), path
    assert jax_spy
    for call in jax_spy:
        _check_call(call, jnp.float16, jnp.float32)


@pytest.mark.parametrize("name", LAYERS)
def test_jax_dtype_bf16(name, jax_spy):
    """Flax policy dtype=bfloat16 with float32 parameters and input: q/k/v bf16, output bf16,
    gates fp32 and (incident 3) computed in fp32."""
    case = CASES_BY_NAME[name]
    sd = tinterop.to_numpy(make_torch_layer(case))
    layer = make_jax_layer(case, sd, dtype=jnp.bfloat16)
    x, _ = draw(case)
    o, _, _ = layer(jnp.asarray(x, jnp.float32))
    assert o.dtype == jnp.bfloat16
    (call,) = jax_spy
    _check_call(call, jnp.bfloat16, jnp.float32)
    if name in ("gdn", "gla", "deltanet"):
        x_seen = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
        for arg, ref in _expected_gates(name, sd, x_seen).items():
            got = np.asarray(call[arg], np.float64)
            assert rel_rms(got, ref, ref) <= 1e-5, f"{arg}: {rel_rms(got, ref, ref):.2e}"


def test_jax_param_dtype_bf16_storage():
    from fla_jax.interop import to_state_dict
    from fla_jax.layers import GatedDeltaNet
    case = CASES_BY_NAME["gdn"]
    layer = GatedDeltaNet(**case.kwargs, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert all(v.dtype == jnp.bfloat16 for v in to_state_dict(layer).values())
    x, _ = draw(case)
    o, _, _ = layer(jnp.asarray(x, jnp.bfloat16))
    assert o.dtype == jnp.bfloat16


def test_jax_modules_keep_activation_dtype():
    from fla_jax.modules import FusedRMSNormGated, RMSNorm, ShortConvolution
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, 16)), jnp.float16)
    conv = ShortConvolution(16, 4, bias=True, rngs=nnx.Rngs(0))
    y, cache = conv(x, output_final_state=True)
    assert y.dtype == jnp.float16 and cache.dtype == jnp.float16
    assert RMSNorm(16)(x).dtype == jnp.float16
    assert FusedRMSNormGated(16)(x, x).dtype == jnp.float16
    assert ShortConvolution(16, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x)[0].dtype == \
        jnp.bfloat16
