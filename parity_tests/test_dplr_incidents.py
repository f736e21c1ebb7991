"""Dtype incidents 1 and 3 (shared/dtype-lessons.md) on RWKV7Attention and KimiDeltaAttention,
in both frameworks (issue 12 point 3).

Incident 1 (RWKV-7 fp16 training: `k.addcmul(k * (a - 1), k_a)` with an fp32 k_a promoted k to
fp32): fp32 parameters with fp16 / bf16 activations -- torch without autocast and under
torch.autocast, Flax with dtype=fp16 / bf16 and param_dtype=fp32 -- forward and backward run,
and r / k / v (q / k / v) reach the op in one dtype, the activation dtype; w, a, b (g, beta)
reach it in float32.
Incident 3 (RWKV-7's decay computed in bf16 under autocast): the log-decay w handed to the op
equals a float64 recomputation from the layer's parameters and the input it saw within 1e-6
relative, under autocast(bf16) and under a bf16 policy (torch policy='bf16', Flax
dtype=bfloat16 with fp32 or bf16 param_dtype); a bf16 computation is off by ~1e-3. KDA's g
and beta likewise.
A spy wrapped around each public op records what the layer hands it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from .cases import rel_rms
from .layer_runners import CASES_BY_NAME, draw, draw_v_first, make_jax_layer, make_torch_layer

import torch  # noqa: E402  (the suite needs every framework: no silent skip)
import jax  # noqa: E402  (the suite needs every framework: no silent skip)
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import fla_jax.ops as jops  # noqa: E402
import fla_torch.ops as tops  # noqa: E402
from fla_torch import interop as tinterop  # noqa: E402

NAMES = ("rwkv7", "rwkv7_vfirst", "kda")
T = 40
ACT = {"rwkv7": ("r", "k", "v"), "kda": ("q", "k", "v")}
GATES = {"rwkv7": ("w", "a", "b"), "kda": ("g", "beta")}
TOL_DECAY = 1e-6


def _case(name):
    return dataclasses.replace(CASES_BY_NAME[name], T=T)


def _family(name):
    return "rwkv7" if name.startswith("rwkv7") else "kda"


def _spy(monkeypatch, module):
    calls = []
    for fam in ("rwkv7", "kda"):
        for mode in ("chunk", "fused_recurrent"):
            original = getattr(module, f"{mode}_{fam}")
            names = ("r", "w", "k", "v", "a", "b") if fam == "rwkv7" else \
                ("q", "k", "v", "g", "beta")

            def spy(*args, _orig=original, _names=names, _fam=fam, **kwargs):
                seen = dict(zip(_names, args))
                seen.update({n: kwargs[n] for n in _names if n in kwargs})
                calls.append({"family": _fam, **seen})
                return _orig(*args, **kwargs)
            monkeypatch.setattr(module, f"{mode}_{fam}", spy)
    return calls


@pytest.fixture
def torch_spy(monkeypatch):
    return _spy(monkeypatch, tops)


@pytest.fixture
def jax_spy(monkeypatch):
    return _spy(monkeypatch, jops)


def _check_call(call, act_dtype, gate_dtype):
    fam = call["family"]
    dts = {n: call[n].dtype for n in ACT[fam]}
    assert all(d == act_dtype for d in dts.values()), f"{fam}: activations {dts}"
    for n in GATES[fam]:
        assert call[n].dtype == gate_dtype, f"{fam}: {n} is {call[n].dtype}"


def _v_first(case, layer, dtype):
    vf = draw_v_first(case, getattr(layer, "value_dim", 0))
    return vf


# ----------------------------------------------------------------------------- incident 1, torch

@pytest.mark.parametrize("how", ["fp16", "autocast-fp16", "autocast-bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_torch_fp32_params_half_activations(name, how, torch_spy):
    case = _case(name)
    layer = make_torch_layer(case)
    x, dy = draw(case)
    vf = _v_first(case, layer, None)
    half = torch.bfloat16 if how.endswith("bf16") else torch.float16
    autocast = how.startswith("autocast")
    in_dtype = torch.float32 if autocast else half
    xt = torch.tensor(x, dtype=in_dtype, requires_grad=True)
    kw = {}
    if vf is not None:
        kw["v_first"] = vt = torch.tensor(vf, dtype=half, requires_grad=True)
    with torch.autocast("cpu", dtype=half, enabled=autocast):
        o = layer(xt, **kw)[0]
    o.float().backward(torch.tensor(dy, dtype=torch.float32))
    assert o.dtype == half and xt.grad.dtype == in_dtype
    assert torch.isfinite(o.float()).all() and torch.isfinite(xt.grad.float()).all()
    if vf is not None:
        assert vt.grad.dtype == half and torch.isfinite(vt.grad.float()).all()
    for pname, p in layer.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, pname
        assert torch.isfinite(p.grad).all(), pname
    assert torch_spy
    for call in torch_spy:
        _check_call(call, half, torch.float32)


# ----------------------------------------------------------------------------- incident 1, jax

@pytest.mark.parametrize("how", ["fp16-input", "dtype-fp16", "dtype-bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_jax_fp32_params_half_activations(name, how, jax_spy):
    case = _case(name)
    tl = make_torch_layer(case)
    half = jnp.bfloat16 if how.endswith("bf16") else jnp.float16
    kw = {} if how == "fp16-input" else {"dtype": half}
    layer = make_jax_layer(case, tinterop.to_numpy(tl), **kw)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    x, dy = draw(case)
    vf = _v_first(case, tl, None)
    xj = jnp.asarray(x, half if how == "fp16-input" else jnp.float32)
    vj = None if vf is None else jnp.asarray(vf, half)

    def loss(params, xj, vj):
        call_kw = {} if vj is None else {"v_first": vj}
        o = nnx.merge(graphdef, params, rest)(xj, **call_kw)[0]
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(dy, jnp.float32)), o

    (_, o), (dparams, dx, dv) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2),
                                                           has_aux=True))(params, xj, vj)
    assert o.dtype == half and dx.dtype == xj.dtype
    assert bool(jnp.isfinite(o.astype(jnp.float32)).all())
    assert bool(jnp.isfinite(dx.astype(jnp.float32)).all())
    if vj is not None:
        assert dv.dtype == half and bool(jnp.isfinite(dv.astype(jnp.float32)).all())
    for path, leaf in jax.tree_util.tree_leaves_with_path(dparams):
        assert leaf.dtype == jnp.float32 and bool(jnp.isfinite(leaf).all()), path
    assert jax_spy
    for call in jax_spy:
        _check_call(call, half, jnp.float32)


# ----------------------------------------------------------------------------- incident 3

def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _expected(name: str, sd: dict, x_seen: np.ndarray, kwargs: dict) -> dict:
    """float64 recomputation of the decay (and KDA's beta) the layer should hand the op."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    x = np.asarray(x_seen, np.float64)
    B, Tn, D = x.shape
    if _family(name) == "rwkv7":
        prev = np.concatenate([np.zeros((B, 1, D)), x[:, :-1]], axis=1)
        xw = x + (prev - x) * sd["x_w"]
        h = np.tanh(xw @ sd["w_lora.lora.0.weight"].T) @ sd["w_lora.lora.2.weight"].T
        w = -np.exp(-0.5) * _sigmoid(h + sd["w_lora.lora.2.bias"])
        return {"w": w.reshape(B, Tn, -1, kwargs["head_dim"])}
    f = (x @ sd["f_proj.0.weight"].T) @ sd["f_proj.1.weight"].T + sd["dt_bias"]
    K = kwargs["head_dim"]
    f = f.reshape(B, Tn, -1, K)
    g = -np.exp(sd["A_log"])[:, None] * np.logaddexp(0.0, f)
    beta = _sigmoid(x @ sd["b_proj.weight"].T)
    return {"g": g, "beta": beta}


def _check_decays(name, calls, sd, x_seen, kwargs, gate_dtype):
    (call,) = calls
    for arg, ref in _expected(name, sd, x_seen, kwargs).items():
        got = np.asarray(call[arg].float() if isinstance(call[arg], torch.Tensor) else call[arg],
                         np.float64)
        assert call[arg].dtype == gate_dtype
        err = rel_rms(got, ref, ref)
        assert err <= TOL_DECAY, f"{name} {arg}: {err:.2e} > {TOL_DECAY:.0e}"


@pytest.mark.parametrize("how", ["autocast", "policy"])
@pytest.mark.parametrize("name", NAMES)
def test_torch_decay_fp32(name, how, torch_spy):
    case = _case(name)
    if how == "policy":
        import fla_torch.layers as tlayers
        torch.manual_seed(0)
        layer = getattr(tlayers, case.cls)(**case.kwargs, policy="bf16")
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(case.perturb * torch.randn_like(p))
        assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    else:
        layer = make_torch_layer(case)
    x, _ = draw(case)
    vf = _v_first(case, layer, None)
    kw = {} if vf is None else {"v_first": torch.tensor(vf, dtype=torch.bfloat16)}
    xt = torch.tensor(x, dtype=torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
        o = layer(xt, **kw)[0]
    assert o.dtype == torch.bfloat16
    x_seen = xt.to(torch.bfloat16).double().numpy()
    _check_call(torch_spy[0], torch.bfloat16, torch.float32)
    _check_decays(name, torch_spy, tinterop.to_numpy(layer), x_seen, case.kwargs, torch.float32)


@pytest.mark.parametrize("how", ["dtype", "policy"])
@pytest.mark.parametrize("name", NAMES)
def test_jax_decay_fp32_bf16_dtype(name, how, jax_spy):
    """dtype=bfloat16 on fp32 parameters; 'policy': bf16 parameters too (param_dtype)."""
    from fla_jax.interop import to_state_dict
    case = _case(name)
    sd = tinterop.to_numpy(make_torch_layer(case))
    extra = {"param_dtype": jnp.bfloat16} if how == "policy" else {}
    layer = make_jax_layer(case, sd, dtype=jnp.bfloat16, **extra)
    sd = to_state_dict(layer)           # the values the layer holds (bf16-rounded: policy)
    x, _ = draw(case)
    vf = _v_first(case, layer, None)
    kw = {} if vf is None else {"v_first": jnp.asarray(vf, jnp.bfloat16)}
    o = layer(jnp.asarray(x, jnp.float32), **kw)[0]
    assert o.dtype == jnp.bfloat16
    x_seen = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    _check_call(jax_spy[0], jnp.bfloat16, jnp.float32)
    _check_decays(name, jax_spy, sd, x_seen, case.kwargs, jnp.float32)


def test_decay_check_can_fail():
    """The 1e-6 bar tells fp32 from bf16: the same recomputation with the LoRA in bf16 (what
    FLA's layer does under autocast) misses it."""
    case = _case("rwkv7")
    layer = make_torch_layer(case)
    x, _ = draw(case)
    sd = tinterop.to_numpy(layer)
    xb = torch.tensor(x, dtype=torch.bfloat16)
    ref = _expected("rwkv7", sd, xb.double().numpy(), case.kwargs)["w"]
    prev = torch.cat([torch.zeros_like(xb[:, :1]), xb[:, :-1]], 1)
    xw = torch.addcmul(xb, prev - xb, layer.x_w.to(torch.bfloat16))
    with torch.no_grad():
        w = -0.6065306597126334 * torch.sigmoid(layer.w_lora.lora.to(torch.bfloat16)(xw))
    err = rel_rms(w.double().numpy().reshape(ref.shape), ref, ref)
    assert err > 10 * TOL_DECAY, f"{err:.2e}"
