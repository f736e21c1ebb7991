"""Every layer (and CausalLM) refuses a bad call with a named error, in both frameworks.

Each bad input -- wrong hidden size, rank, dtype, a 16-bit dtype other than the layer's explicit
compute dtype, a bad attention_mask, a cache of another batch size or another layer -- must
raise TypeError / ValueError whose message names the layer, the argument, what was given and
what is expected; the two frameworks must say the same words (fla_contract.layer_inputs).
Autocast and an fp32 input into a bf16-computing layer keep working.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import torch  # noqa: E402  (the suite needs every framework: no silent skip)
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import fla_jax.layers as jl  # noqa: E402
import fla_jax.models as jm  # noqa: E402
import fla_torch.layers as tl  # noqa: E402
import fla_torch.models as tm  # noqa: E402

D = 32
LAYERS = {   # one small configuration per layer class; with short convs where the layer has them
    "LinearAttention": dict(hidden_size=D, num_heads=2, do_feature_map_norm=True),
    "MultiScaleRetention": dict(hidden_size=D, num_heads=2, use_short_conv=True),
    "GatedLinearAttention": dict(hidden_size=D, num_heads=2, use_short_conv=True),
    "DeltaNet": dict(hidden_size=D, num_heads=2),
    "GatedDeltaNet": dict(hidden_size=D, head_dim=8, num_heads=2, num_v_heads=4),
    "Attention": dict(hidden_size=D, num_heads=4, num_kv_heads=2, qk_norm=True),
}
OTHER = {   # a layer of the same class whose cache has other sizes
    "LinearAttention": dict(hidden_size=D, num_heads=4, do_feature_map_norm=True),
    "MultiScaleRetention": dict(hidden_size=D, num_heads=4, use_short_conv=True),
    "GatedLinearAttention": dict(hidden_size=D, num_heads=4, use_short_conv=True),
    "DeltaNet": dict(hidden_size=D, num_heads=4),
    "GatedDeltaNet": dict(hidden_size=D, head_dim=8, num_heads=2, num_v_heads=2),
    "Attention": dict(hidden_size=D, num_heads=4, num_kv_heads=1),
}
NAMES = tuple(LAYERS)
# the cache entry a batch mismatch is reported on
FIRST_CACHE_KEY = {"Attention": "past_key_values['attn_state'][0] (k)"}


def _torch_layer(name, kw=None, **extra):
    torch.manual_seed(0)
    return getattr(tl, name)(**(kw or LAYERS[name]), **extra)


def _jax_layer(name, kw=None, **extra):
    return getattr(jl, name)(**(kw or LAYERS[name]), **extra, rngs=nnx.Rngs(0))


def _x(fw, shape, dtype="fp32"):
    a = np.random.default_rng(0).standard_normal(shape)
    if fw == "torch":
        return torch.tensor(a).to({"fp32": torch.float32, "fp16": torch.float16,
                                   "bf16": torch.bfloat16, "int": torch.int32}[dtype])
    return jnp.asarray(a).astype({"fp32": jnp.float32, "fp16": jnp.float16,
                                  "bf16": jnp.bfloat16, "int": jnp.int32}[dtype])


def _raises(fn, exc, *words) -> str:
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


def _both(name, call, exc, *words):
    """Run call(layer, fw) in both frameworks; both raise exc with the words, in the same text."""
    msgs = [_raises(lambda: call(make(name), fw), exc, name, *words)
            for fw, make in (("torch", _torch_layer), ("jax", _jax_layer))]
    assert msgs[0] == msgs[1], msgs
    return msgs[0]


@pytest.mark.parametrize("name", NAMES)
def test_wrong_hidden_size(name):
    _both(name, lambda layer, fw: layer(_x(fw, (2, 5, 16))), ValueError,
          "hidden_states", "[2, 5, 16]", f"[B, T, {D}]", f"hidden_size={D}")


@pytest.mark.parametrize("name", NAMES)
def test_wrong_rank(name):
    _both(name, lambda layer, fw: layer(_x(fw, (5, D))), ValueError,
          "hidden_states", "[5, 32]", "rank 2", "expected rank 3")


@pytest.mark.parametrize("name", NAMES)
def test_integer_hidden_states(name):
    _both(name, lambda layer, fw: layer(_x(fw, (2, 5, D), "int")), TypeError,
          "hidden_states", "has dtype int", "expected a floating dtype")


@pytest.mark.parametrize("name", NAMES)
def test_not_an_array(name):
    _raises(lambda: _torch_layer(name)([[0.0] * D]), TypeError, name, "hidden_states", "list",
            "torch.Tensor")
    _raises(lambda: _jax_layer(name)([[0.0] * D]), TypeError, name, "hidden_states", "list",
            "jax.Array")


@pytest.mark.parametrize("name", NAMES)
def test_other_16bit_than_compute_dtype(name):
    """An explicit compute dtype (torch policy, Flax dtype) of bf16 refuses an fp16 input (a
    silent re-rounding) and takes fp32 (the policy's purpose: mixed precision)."""
    t = _torch_layer(name, policy="bf16")
    j = _jax_layer(name, dtype=jnp.bfloat16)
    for layer, fw in ((t, "torch"), (j, "jax")):
        _raises(lambda: layer(_x(fw, (2, 3, D), "fp16")), TypeError, name, "hidden_states",
                "float16", "computes in bfloat16", "expected bfloat16 or float32")
        o = layer(_x(fw, (2, 3, D), "fp32"))[0]
        assert "bfloat16" in str(o.dtype)


def test_autocast_takes_any_float():
    layer = _torch_layer("GatedDeltaNet")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for dt in ("fp32", "fp16"):
            assert layer(_x("torch", (2, 3, D), dt))[0].dtype == torch.bfloat16


@pytest.mark.parametrize("name", NAMES)
def test_attention_mask_shape_and_dtype(name):
    _both(name, lambda layer, fw: layer(_x(fw, (2, 5, D)),
                                        attention_mask=_x(fw, (2, 4))), ValueError,
          "attention_mask", "[2, 4]", "expected [B, T] = [2, 5]")
    t_mask = torch.ones(2, 5, dtype=torch.complex64)
    j_mask = jnp.ones((2, 5), jnp.complex64)
    _raises(lambda: _torch_layer(name)(_x("torch", (2, 5, D)), attention_mask=t_mask),
            TypeError, name, "attention_mask", "complex64", "expected bool")
    _raises(lambda: _jax_layer(name)(_x("jax", (2, 5, D)), attention_mask=j_mask),
            TypeError, name, "attention_mask", "complex64", "expected bool")


def _cache(layer, fw, B=2, T=3):
    return layer(_x(fw, (B, T, D)), use_cache=True)[2]


@pytest.mark.parametrize("name", NAMES)
def test_cache_of_another_batch(name):
    def call(layer, fw):
        return layer(_x(fw, (3, 1, D)), past_key_values=_cache(layer, fw, B=2))
    _both(name, call, ValueError,
          FIRST_CACHE_KEY.get(name, "past_key_values['recurrent_state']"), "[2, ", "[3, ",
          "another batch size")


def test_attention_and_linear_caches_do_not_mix():
    """A hybrid model's per-layer caches: an Attention cache handed to a linear layer and a
    linear layer's cache handed to Attention both raise TypeError naming the layer."""
    for fw, make in (("torch", _torch_layer), ("jax", _jax_layer)):
        kv = _cache(make("Attention"), fw)
        rec = _cache(make("GatedDeltaNet"), fw)
        _raises(lambda: make("GatedDeltaNet")(_x(fw, (2, 1, D)), past_key_values=kv),
                TypeError, "GatedDeltaNet", "past_key_values is dict", "recurrent_state")
        _raises(lambda: make("Attention")(_x(fw, (2, 1, D)), past_key_values=rec),
                TypeError, "Attention", "without 'attn_state'", "attn_state, attn_mask")


@pytest.mark.parametrize("name", NAMES)
def test_cache_of_another_layer(name):
    for fw, make in (("torch", _torch_layer), ("jax", _jax_layer)):
        other = _cache(make(name, OTHER[name]), fw)
        _raises(lambda: make(name)(_x(fw, (2, 1, D)), past_key_values=other), ValueError,
                name, "past_key_values[", "expected", "another layer")


@pytest.mark.parametrize("name", ("LinearAttention", "DeltaNet"))
def test_cache_with_or_without_short_convs(name):
    """A cache with conv states into a layer without short convs, and the reverse."""
    with_conv = dict(LAYERS[name], use_short_conv=True)
    without = dict(LAYERS[name], use_short_conv=False)
    if name == "LinearAttention":       # no short convs at all: take GLA's cache
        for fw, make in (("torch", _torch_layer), ("jax", _jax_layer)):
            gla = _cache(make("GatedLinearAttention", dict(LAYERS["GatedLinearAttention"],
                                                           num_heads=2)), fw)
            _raises(lambda: make(name)(_x(fw, (2, 1, D)), past_key_values=gla), ValueError,
                    name, "conv_state", "another layer")
        return
    _both(name, lambda layer, fw: _make(fw, name, without)(
        _x(fw, (2, 1, D)), past_key_values=_cache(_make(fw, name, with_conv), fw)),
        ValueError, "conv_state", "no short convolutions")
    _both(name, lambda layer, fw: _make(fw, name, with_conv)(
        _x(fw, (2, 1, D)), past_key_values=_cache(_make(fw, name, without), fw)),
        ValueError, "conv_state", "use_short_conv=True")


def _make(fw, name, kw):
    with warnings.catch_warnings():     # use_short_conv=False warns about quality
        warnings.simplefilter("ignore", UserWarning)
        return (_torch_layer if fw == "torch" else _jax_layer)(name, kw)


@pytest.mark.parametrize("name", NAMES)
def test_cache_not_a_dict(name):
    _both(name, lambda layer, fw: layer(_x(fw, (2, 1, D)), past_key_values=[None]), TypeError,
          "past_key_values is list", "cache dict")


def test_causal_lm_input_ids():
    kw = dict(vocab_size=50, hidden_size=D, num_layers=1, num_heads=2, head_dim=16)
    t = tm.CausalLM(tm.LMConfig(**kw))
    j = jm.CausalLM(jm.LMConfig(**kw), rngs=nnx.Rngs(0))
    for model, arr in ((t, torch.tensor), (j, jnp.asarray)):
        _raises(lambda: model(arr([[0.5, 1.5]])), TypeError, "CausalLM", "input_ids",
                "float32", "token ids")
        _raises(lambda: model(arr([[[1, 2]]])), ValueError, "CausalLM", "input_ids",
                "[1, 1, 2]", "[B, T]")
        _raises(lambda: model(arr([[1, 50]])), ValueError, "CausalLM", "input_ids", "50",
                "[0, 50)")
        _raises(lambda: model(arr([[-1, 2]])), ValueError, "CausalLM", "input_ids", "-1",
                "[0, 50)")
        _raises(lambda: model([[1, 2]]), TypeError, "CausalLM", "input_ids", "list")
    assert tuple(t(torch.zeros(2, 3, dtype=torch.long)).shape) == (2, 3, 50)
    assert tuple(j(jnp.zeros((2, 3), jnp.int32)).shape) == (2, 3, 50)
