"""Layers across frameworks: parity of outputs and gradients, decode == full forward, lossless
weight round trips, and FLA state_dicts loading strictly into fla_torch layers.

Parity: one seeded fla_torch layer gives the weights (fp32 parameters); fla_jax gets them
through fla_jax.interop.from_state_dict. x and the output cotangent are drawn once in float64,
rounded to the dtype under test, and fed to both; the oracle is the torch layer in float64 on
the rounded values. Metric RMS(a - b) / RMS(oracle); tolerances: cases.LAYER_TOLERANCE.
"""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

from .cases import CROSS_FACTOR, LAYER_TOLERANCE, rel_rms
from .layer_runners import (CASES_BY_NAME, LAYER_CASES, draw, draw_v_first, make_jax_layer,
                            make_torch_layer, run_jax, run_torch)

import torch  # noqa: E402  (the suite needs every framework: no silent skip)
import jax  # noqa: E402  (the suite needs every framework: no silent skip)
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from fla_jax import interop as jinterop  # noqa: E402
from fla_torch import interop as tinterop  # noqa: E402

BASE = ("gdn", "deltanet", "gla", "gsa", "retention", "linear_attn", "attn", "rwkv7",
        "kda")   # one per layer class
PARITY = ([(c, d) for c in BASE for d in ("fp32", "bf16", "fp16")]
          + [(c.name, d) for c in LAYER_CASES if c.name not in BASE for d in ("fp32", "bf16")])


def _round(a: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes
    npd = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype]
    return a.astype(npd).astype(np.float64)


@functools.lru_cache(maxsize=None)
def _layers(name: str):
    case = CASES_BY_NAME[name]
    tl = make_torch_layer(case)
    sd = tinterop.to_numpy(tl)
    return case, tl, sd


@pytest.mark.parametrize("name,dtype", PARITY, ids=[f"{c}-{d}" for c, d in PARITY])
def test_layer_parity(name, dtype):
    case, tl, sd = _layers(name)
    jl = make_jax_layer(case, sd)
    x, dy = draw(case)
    vf = draw_v_first(case, getattr(tl, "value_dim", 0))
    vf_ref = None if vf is None else _round(vf, dtype)
    ref = run_torch(copy.deepcopy(tl).double(), _round(x, dtype), _round(dy, dtype), "fp64",
                    v_first=vf_ref)
    rt = run_torch(tl, x, dy, dtype, v_first=vf)
    rj = run_jax(jl, x, dy, dtype, v_first=vf)

    torch_dt = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}
    jax_dt = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    assert rt["o_dtype"] == rt["dx_dtype"] == torch_dt[dtype]
    assert rj["o_dtype"] == rj["dx_dtype"] == jax_dt[dtype]
    keys = sorted(k for k in ref if k in ("o", "dx", "v_first", "dv_first") or k.startswith("d:"))
    assert set(keys) <= set(rt) and set(keys) <= set(rj), "gradient names differ"
    assert len([k for k in keys if k.startswith("d:")]) == len(sd) - _tied(case)
    failures = []
    for k in keys:
        tol = LAYER_TOLERANCE[dtype]["o" if k in ("o", "v_first") else "grad"]
        errs = {"torch": rel_rms(rt[k], ref[k], ref[k]), "jax": rel_rms(rj[k], ref[k], ref[k]),
                "jax-torch": rel_rms(rj[k], rt[k], ref[k])}
        for who, err in errs.items():
            limit = tol * (CROSS_FACTOR if who == "jax-torch" else 1.0)
            if not err <= limit:
                failures.append(f"{k} {who}: {err:.3e} > {limit:.1e}")
    assert not failures, f"{name} {dtype}: " + "; ".join(failures)


def _tied(case) -> int:
    """Parameters a torch state_dict lists twice (tied feature maps) but named_parameters once."""
    if case.cls == "LinearAttention" and case.kwargs.get("tie_feature_map_qk"):
        return 4
    return 0


# ----------------------------------------------------------------------------- decode

SPLITS = (7, 66, 1, 1, 1, 1, 1)     # prefill 7 (chunk), 66 more (chunk, from the cache), 5 singles


def _decode_torch(tl, x, vf=None):
    """vf: RWKV-7's v_first [B, T, value_dim] (sliced with the tokens), or None."""
    with torch.no_grad():
        xt = torch.tensor(x, dtype=torch.float32)
        vt = None if vf is None else torch.tensor(vf, dtype=torch.float32)
        kw = lambda a, b: {} if vt is None else {"v_first": vt[:, a:b]}
        full, _, cache_full = tl(xt, use_cache=True, **kw(0, None))[:3]
        outs, cache, t = [], None, 0
        for n in SPLITS:
            o, _, cache = tl(xt[:, t:t + n], past_key_values=cache, use_cache=True,
                             **kw(t, t + n))[:3]
            outs.append(o)
            t += n
    return full.numpy(), torch.cat(outs, 1).numpy(), cache_full, cache


def _decode_jax(jl, x, vf=None):
    graphdef, state = nnx.split(jl)

    @jax.jit
    def step(state, xs, cache, vs):
        kw = {} if vs is None else {"v_first": vs}
        o, _, new_cache = nnx.merge(graphdef, state)(xs, past_key_values=cache, use_cache=True,
                                                    **kw)[:3]
        return o, new_cache

    xj = jnp.asarray(x, jnp.float32)
    vj = None if vf is None else jnp.asarray(vf, jnp.float32)
    sl = lambda a, b: None if vj is None else vj[:, a:b]
    full, cache_full = step(state, xj, None, vj)
    outs, cache, t = [], None, 0
    for n in SPLITS:
        o, cache = step(state, xj[:, t:t + n], cache, sl(t, t + n))
        outs.append(o)
        t += n
    return np.asarray(full), np.asarray(jnp.concatenate(outs, 1)), cache_full, cache


def _np_state(cache):
    out = {"offset": int(cache["offset"])}
    state = cache.get("recurrent_state")
    for i, part in enumerate(state if isinstance(state, tuple) else (state,)):   # GSA: (hk, hv)
        if part is not None:
            out[f"recurrent_state{i or ''}"] = np.asarray(part, np.float64)
    if cache.get("attn_state") is not None:     # Attention: keys and values so far
        out["k"], out["v"] = (np.asarray(a, np.float64) for a in cache["attn_state"])
    if cache.get("conv_state") is not None:
        for i, c in enumerate(cache["conv_state"]):
            out[f"conv{i}"] = np.asarray(c, np.float64)
    if "k_sum" in cache:
        out["k_sum"] = np.asarray(cache["k_sum"], np.float64)
    if cache.get("shift_state") is not None:       # RWKV-7's token shift
        out["shift_state"] = np.asarray(cache["shift_state"], np.float64)
    return out


DECODE_CASES = [c.name for c in LAYER_CASES]


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_equals_full_forward(name):
    """Prefill + cached chunks + token-by-token decoding == one forward, in both frameworks
    (fp32), and the two frameworks' final caches agree."""
    case, tl, sd = _layers(name)
    x = np.random.default_rng(2).standard_normal((case.B, sum(SPLITS), tl.hidden_size))
    vf = (np.random.default_rng(4).standard_normal((case.B, sum(SPLITS), tl.value_dim))
          if case.v_first else None)
    jl = make_jax_layer(case, sd)
    tol = LAYER_TOLERANCE["fp32"]["o"]
    results = {"torch": _decode_torch(tl, x, vf), "jax": _decode_jax(jl, x, vf)}
    for fw, (full, stepped, cache_full, cache) in results.items():
        err = rel_rms(stepped, full, full)
        assert err <= tol, f"{fw} decode vs full forward: {err:.3e} > {tol:.1e}"
        a, b = _np_state(cache), _np_state(cache_full)
        assert a.keys() == b.keys() and a["offset"] == b["offset"] == x.shape[1]
        for key in a:
            if key != "offset":
                assert rel_rms(a[key], b[key], b[key]) <= tol, f"{fw} cache {key}"
    for fw, f32 in (("torch", torch.float32), ("jax", jnp.float32)):
        state = results[fw][3].get("recurrent_state")
        for part in (state if isinstance(state, tuple) else (state,)):
            assert part is None or part.dtype == f32
    ct, cj = _np_state(results["torch"][3]), _np_state(results["jax"][3])
    for key in ct:
        if key != "offset":
            err = rel_rms(cj[key], ct[key], ct[key])
            assert err <= tol * CROSS_FACTOR, f"cache {key} jax vs torch: {err:.3e}"


# ----------------------------------------------------------------------------- weights

def _assert_bit_equal(a: dict, b: dict):
    assert list(a) == list(b) or set(a) == set(b), (sorted(a), sorted(b))
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        assert x.tobytes() == y.tobytes(), f"{k} differs"


@pytest.mark.parametrize("name", DECODE_CASES)
def test_state_dict_round_trip_is_lossless(name, tmp_path):
    """torch -> numpy -> fla_jax -> numpy -> torch, and through safetensors files both ways:
    fp32 bit-exact, same names (torch's), same shapes."""
    case, tl, sd = _layers(name)
    jl = make_jax_layer(case, sd)
    back = jinterop.to_state_dict(jl)
    assert set(back) == set(tl.state_dict())
    _assert_bit_equal(sd, back)

    fresh = make_torch_layer(case, seed=123)
    fresh.load_state_dict(tinterop.from_numpy(back), strict=True)
    _assert_bit_equal(sd, tinterop.to_numpy(fresh))

    # torch file -> jax -> jax file -> torch
    tinterop.save_safetensors(tl, tmp_path / "t.safetensors")
    jl2 = make_jax_layer(case, tinterop.to_numpy(make_torch_layer(case, seed=7)))
    jinterop.load_safetensors(jl2, tmp_path / "t.safetensors")
    _assert_bit_equal(sd, jinterop.to_state_dict(jl2))
    jinterop.save_safetensors(jl2, tmp_path / "j.safetensors")
    fresh2 = make_torch_layer(case, seed=9)
    tinterop.load_safetensors(fresh2, tmp_path / "j.safetensors", strict=True)
    _assert_bit_equal(sd, tinterop.to_numpy(fresh2))


@pytest.mark.parametrize("name", BASE)
def test_bf16_parameters_round_trip(name):
    """bf16 parameter storage on both sides (dtype=torch.bfloat16 / param_dtype=jnp.bfloat16)
    survives torch -> jax -> torch bit for bit."""
    case = CASES_BY_NAME[name]
    torch.manual_seed(0)
    import fla_torch.layers as tlayers
    tl = getattr(tlayers, case.cls)(**case.kwargs, dtype=torch.bfloat16)
    sd = tinterop.to_numpy(tl)
    assert all(v.dtype.name == "bfloat16" for v in sd.values())
    jl = make_jax_layer(case, sd, param_dtype=jnp.bfloat16)
    back = jinterop.to_state_dict(jl)
    _assert_bit_equal(sd, back)
    fresh = getattr(tlayers, case.cls)(**case.kwargs, dtype=torch.bfloat16)
    fresh.load_state_dict(tinterop.from_numpy(back), strict=True)
    _assert_bit_equal(sd, tinterop.to_numpy(fresh))


def test_from_state_dict_errors_name_the_key():
    case, tl, sd = _layers("gdn")
    jl = make_jax_layer(case, sd)
    bad = dict(sd)
    bad["q_proj.weight"] = bad["q_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match="q_proj.weight"):
        jinterop.from_state_dict(jl, bad)
    missing = {k: v for k, v in sd.items() if k != "A_log"}
    with pytest.raises(KeyError, match="A_log"):
        jinterop.from_state_dict(jl, missing)
    extra = dict(sd, **{"bogus.weight": np.zeros(3, np.float32)})
    with pytest.raises(KeyError, match="bogus.weight"):
        jinterop.from_state_dict(jl, extra)
    result = jinterop.from_state_dict(jl, missing, strict=False)
    assert result.missing_keys == ["A_log"] and result.unexpected_keys == []


# ----------------------------------------------------------------------------- FLA key sets

# FLA's state_dict keys and shapes for these constructor arguments, written out by hand from
# FLA's layer definitions (fla/layers/*.py, fla/modules/*), so the test does not need FLA.
FLA_STATE_DICTS = {
    "GatedDeltaNet": (
        dict(hidden_size=64, expand_v=2, head_dim=16, num_heads=2, num_v_heads=4),
        {"A_log": [4], "dt_bias": [4], "q_proj.weight": [32, 64], "k_proj.weight": [32, 64],
         "v_proj.weight": [128, 64], "a_proj.weight": [4, 64], "b_proj.weight": [4, 64],
         "q_conv1d.weight": [32, 1, 4], "k_conv1d.weight": [32, 1, 4],
         "v_conv1d.weight": [128, 1, 4], "g_proj.weight": [128, 64], "o_norm.weight": [32],
         "o_proj.weight": [64, 128]}),
    "GatedDeltaNet-nogate-bias": (
        dict(hidden_size=64, expand_v=1, head_dim=16, num_heads=4, use_gate=False,
             conv_bias=True, conv_size=3),
        {"A_log": [4], "dt_bias": [4], "q_proj.weight": [64, 64], "k_proj.weight": [64, 64],
         "v_proj.weight": [64, 64], "a_proj.weight": [4, 64], "b_proj.weight": [4, 64],
         "q_conv1d.weight": [64, 1, 3], "q_conv1d.bias": [64], "k_conv1d.weight": [64, 1, 3],
         "k_conv1d.bias": [64], "v_conv1d.weight": [64, 1, 3], "v_conv1d.bias": [64],
         "o_norm.weight": [16], "o_proj.weight": [64, 64]}),
    "GatedLinearAttention": (
        dict(hidden_size=64, num_heads=4, num_kv_heads=2, use_short_conv=True),
        {"q_proj.weight": [32, 64], "k_proj.weight": [16, 64], "v_proj.weight": [32, 64],
         "g_proj.weight": [64, 64], "q_conv1d.weight": [32, 1, 4],
         "k_conv1d.weight": [16, 1, 4], "v_conv1d.weight": [32, 1, 4],
         "gk_proj.0.weight": [16, 64], "gk_proj.1.weight": [16, 16], "gk_proj.1.bias": [16],
         "o_proj.weight": [64, 64], "g_norm_swish_gate.weight": [16]}),
    "GatedLinearAttention-unfused": (
        dict(hidden_size=64, num_heads=4, fuse_norm=False),
        {"q_proj.weight": [32, 64], "k_proj.weight": [32, 64], "v_proj.weight": [64, 64],
         "g_proj.weight": [64, 64], "gk_proj.0.weight": [16, 64], "gk_proj.1.weight": [32, 16],
         "gk_proj.1.bias": [32], "o_proj.weight": [64, 64], "g_norm.weight": [16]}),
    "DeltaNet": (
        dict(hidden_size=64, num_heads=4, use_gate=True),
        {"q_proj.weight": [64, 64], "k_proj.weight": [64, 64], "v_proj.weight": [64, 64],
         "b_proj.weight": [4, 64], "q_conv1d.weight": [64, 1, 4], "k_conv1d.weight": [64, 1, 4],
         "v_conv1d.weight": [64, 1, 4], "g_proj.weight": [64, 64], "o_norm.weight": [16],
         "o_proj.weight": [64, 64]}),
    "MultiScaleRetention": (
        dict(hidden_size=64, num_heads=4),
        {"q_proj.weight": [64, 64], "k_proj.weight": [64, 64], "v_proj.weight": [128, 64],
         "g_proj.weight": [128, 64], "o_proj.weight": [64, 128],
         "g_norm_swish_gate.weight": [32]}),
    "LinearAttention": (
        dict(hidden_size=64, num_heads=4),
        {"feature_map_q.layer1.weight": [16, 16], "feature_map_q.layer1.bias": [16],
         "feature_map_q.layer2.weight": [16, 16], "feature_map_q.layer2.bias": [16],
         "feature_map_k.layer1.weight": [16, 16], "feature_map_k.layer1.bias": [16],
         "feature_map_k.layer2.weight": [16, 16], "feature_map_k.layer2.bias": [16],
         "q_proj.weight": [64, 64], "k_proj.weight": [64, 64], "v_proj.weight": [64, 64],
         "norm.weight": [16], "o_proj.weight": [64, 64]}),
    "Attention": (
        dict(hidden_size=64, num_heads=4, num_kv_heads=2, qk_norm=True),
        {"q_proj.weight": [64, 64], "k_proj.weight": [32, 64], "v_proj.weight": [32, 64],
         "o_proj.weight": [64, 64], "q_norm.weight": [16], "k_norm.weight": [16]}),
    "RWKV7Attention": (
        dict(hidden_size=64, head_dim=16, layer_idx=0),
        {**{f"x_{c}": [1, 1, 64] for c in "rwkvag"}, "k_k": [64], "k_a": [64], "r_k": [4, 16],
         "r_proj.weight": [64, 64], "k_proj.weight": [64, 64], "v_proj.weight": [64, 64],
         "o_proj.weight": [64, 64], "w_lora.lora.0.weight": [32, 64],
         "w_lora.lora.2.weight": [64, 32], "w_lora.lora.2.bias": [64],
         "a_lora.lora.0.weight": [32, 64], "a_lora.lora.2.weight": [64, 32],
         "a_lora.lora.2.bias": [64], "g_lora.lora.0.weight": [32, 64],
         "g_lora.lora.2.weight": [64, 32], "g_norm.weight": [64], "g_norm.bias": [64]}),
    "RWKV7Attention-vlora-noaffine": (
        dict(hidden_size=64, head_dim=None, num_heads=4, elementwise_affine=False,
             fuse_norm=True),
        {**{f"x_{c}": [1, 1, 64] for c in "rwkvag"}, "k_k": [64], "k_a": [64], "r_k": [4, 16],
         "r_proj.weight": [64, 64], "k_proj.weight": [64, 64], "v_proj.weight": [64, 64],
         "o_proj.weight": [64, 64], "w_lora.lora.0.weight": [32, 64],
         "w_lora.lora.2.weight": [64, 32], "w_lora.lora.2.bias": [64],
         "v_lora.lora.0.weight": [32, 64], "v_lora.lora.2.weight": [64, 32],
         "v_lora.lora.2.bias": [64], "a_lora.lora.0.weight": [32, 64],
         "a_lora.lora.2.weight": [64, 32], "a_lora.lora.2.bias": [64],
         "g_lora.lora.0.weight": [32, 64], "g_lora.lora.2.weight": [64, 32]}),
    "KimiDeltaAttention": (
        dict(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=2),
        {"A_log": [4], "dt_bias": [64], "q_proj.weight": [32, 64], "k_proj.weight": [32, 64],
         "v_proj.weight": [128, 64], "q_conv1d.weight": [32, 1, 4],
         "k_conv1d.weight": [32, 1, 4], "v_conv1d.weight": [128, 1, 4],
         "f_proj.0.weight": [32, 64], "f_proj.1.weight": [64, 32], "b_proj.weight": [4, 64],
         "g_proj.0.weight": [32, 64], "g_proj.1.weight": [128, 32], "g_proj.1.bias": [128],
         "o_norm.weight": [32], "o_proj.weight": [64, 128]}),
    "Attention-bias-window": (
        dict(hidden_size=64, num_heads=4, qkv_bias=True, window_size=4),
        {"q_proj.weight": [64, 64], "q_proj.bias": [64], "k_proj.weight": [64, 64],
         "k_proj.bias": [64], "v_proj.weight": [64, 64], "v_proj.bias": [64],
         "o_proj.weight": [64, 64]}),
}


@pytest.mark.parametrize("key", list(FLA_STATE_DICTS))
def test_fla_state_dict_loads_strict(key):
    """An FLA layer's state_dict (same constructor arguments) loads with strict=True into our
    torch layer and, through interop, into our Flax layer; outputs then agree."""
    import fla_torch.layers as tlayers
    cls = key.split("-")[0]
    kwargs, shapes = FLA_STATE_DICTS[key]
    gen = torch.Generator().manual_seed(0)
    fla_sd = {k: 0.2 * torch.randn(*shape, generator=gen) for k, shape in shapes.items()}
    layer = getattr(tlayers, cls)(**kwargs)
    layer.load_state_dict(fla_sd, strict=True)
    assert {k: list(v.shape) for k, v in layer.state_dict().items()} == shapes
    from fla_jax import layers as jlayers
    jl = getattr(jlayers, cls)(**kwargs, rngs=nnx.Rngs(0))
    jinterop.from_state_dict(jl, tinterop.to_numpy(fla_sd))
    x = np.random.default_rng(0).standard_normal((1, 9, kwargs["hidden_size"]))
    vf = {}
    if cls == "RWKV7Attention" and kwargs.get("layer_idx") != 0:
        vf = {"v_first": np.random.default_rng(1).standard_normal((1, 9, layer.value_dim))}
    with torch.no_grad():
        ot = layer(torch.tensor(x, dtype=torch.float32),
                   **{k: torch.tensor(v, dtype=torch.float32) for k, v in vf.items()})[0].numpy()
    oj = np.asarray(jl(jnp.asarray(x, jnp.float32),
                       **{k: jnp.asarray(v, jnp.float32) for k, v in vf.items()})[0])
    assert rel_rms(oj, ot, ot) <= LAYER_TOLERANCE["fp32"]["o"] * CROSS_FACTOR


# ----------------------------------------------------------------------------- sanity

def test_parity_metric_catches_a_perturbed_weight():
    """The comparison can fail: a 1% change of one small parameter (dt_bias) in the Flax copy
    moves the output far beyond the fp32 tolerance."""
    case, tl, sd = _layers("gdn")
    bad = dict(sd, dt_bias=sd["dt_bias"] * np.float32(1.01))
    jl = make_jax_layer(case, bad)
    x, _ = draw(case)
    with torch.no_grad():
        ot = tl(torch.tensor(x, dtype=torch.float32))[0].numpy()
    oj = np.asarray(jl(jnp.asarray(x, jnp.float32))[0])
    assert rel_rms(oj, ot, ot) > 10 * LAYER_TOLERANCE["fp32"]["o"] * CROSS_FACTOR


@pytest.mark.parametrize("name", ["gdn", "gla"])
def test_torch_autocast_matches_flax_bf16_dtype(name):
    """Mixed precision across frameworks: torch autocast(bf16) on fp32 parameters and the
    Flax layer with dtype=bfloat16 on the same fp32 parameters give the same bf16 output."""
    case, tl, sd = _layers(name)
    jl = make_jax_layer(case, sd, dtype=jnp.bfloat16)
    x, _ = draw(case)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ot = tl(torch.tensor(x, dtype=torch.float32))[0]
    oj = jl(jnp.asarray(x, jnp.float32))[0]
    assert ot.dtype == torch.bfloat16 and oj.dtype == jnp.bfloat16
    ref = run_torch(copy.deepcopy(tl).double(), _round(x, "bf16"), np.zeros_like(x), "fp64")["o"]
    err = rel_rms(np.asarray(oj.astype(jnp.float32), np.float64), ot.double().numpy(), ref)
    assert err <= LAYER_TOLERANCE["bf16"]["o"] * CROSS_FACTOR, f"{err:.3e}"


# ----------------------------------------------------------------------------- packed sequences

CU = (0, 5, 5, 40, 47)      # includes an empty sequence


# Attention: packed calls run (test_attention_layer.py) but return no per-sequence KV cache
@pytest.mark.parametrize("name", [c.name for c in LAYER_CASES
                                  if not c.kwargs.get("do_feature_map_norm")
                                  and c.cls != "Attention" and not c.v_first])
def test_packed_sequences(name):
    """cu_seqlens (B == 1): packed == each sequence alone; the returned cache (one row per
    sequence, per-sequence offsets) continues every sequence with one decoding step; fla_jax
    matches fla_torch. fp32."""
    case, tl, sd = _layers(name)
    jl = make_jax_layer(case, sd)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, CU[-1], tl.hidden_size))
    xn = rng.standard_normal((len(CU) - 1, 1, tl.hidden_size))
    tol = LAYER_TOLERANCE["fp32"]["o"]
    f32 = functools.partial(torch.tensor, dtype=torch.float32)
    with torch.no_grad():
        packed, _, cache = tl(f32(x), cu_seqlens=torch.tensor(CU), use_cache=True)[:3]
        step = tl(f32(xn), past_key_values=cache, use_cache=True)[0]
        alone, cont = [], []
        for n, (a, b) in enumerate(zip(CU[:-1], CU[1:])):
            if b > a:
                alone.append(tl(f32(x[:, a:b]))[0])
            whole = np.concatenate([x[:, a:b], xn[n:n + 1]], axis=1)
            cont.append(tl(f32(whole))[0][:, -1:])
    alone, cont = torch.cat(alone, 1).numpy(), torch.cat(cont, 0).numpy()
    packed, step = packed.numpy(), step.numpy()
    assert rel_rms(packed, alone, alone) <= tol
    assert rel_rms(step, cont, cont) <= tol
    graphdef, state = nnx.split(jl)

    @jax.jit
    def run(state, x, cu_seqlens, cache):
        o, _, c = nnx.merge(graphdef, state)(x, past_key_values=cache, use_cache=True,
                                            cu_seqlens=cu_seqlens)[:3]
        return o, c

    pj, cj = run(state, jnp.asarray(x, jnp.float32), jnp.asarray(CU, jnp.int32), None)
    sj, _ = run(state, jnp.asarray(xn, jnp.float32), None, cj)
    assert rel_rms(np.asarray(pj), packed, packed) <= tol * CROSS_FACTOR
    assert rel_rms(np.asarray(sj), step, step) <= tol * CROSS_FACTOR
