"""Padding masks (FLA's attention_mask [B, T], 1 = real token, 0 = padding) in every layer, in
both frameworks (fp32, CPU; JAX under jit).

A padded batch must equal each sequence run alone without padding: the outputs at real
positions, the final recurrent state, the conv caches, LinearAttention's k_sum and the
per-row offset; for left padding, right padding, and decoding continued from a left-padded
prefill (one token at a time, with a mask of ones, then a step where one row is padding and
must leave its cache untouched); inner padding too; a layer in mode='fused_recurrent'.
Outputs at padded positions are 0. Then torch == jax on the padded batch (outputs, caches,
input and parameter gradients), and the named errors.
Inputs at padded positions are random, never zeros, so a leak shows.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from .cases import LAYER_TOLERANCE, rel_rms
from .layer_runners import HIDDEN, LayerCase, make_jax_layer, make_torch_layer

import torch  # noqa: E402  (the suite needs every framework: no silent skip)
import jax  # noqa: E402  (the suite needs every framework: no silent skip)
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from fla_torch import interop as tinterop  # noqa: E402

CASES = {c.name: c for c in (
    LayerCase("gdn", "GatedDeltaNet",
              dict(hidden_size=HIDDEN, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1.5)),
    LayerCase("deltanet", "DeltaNet", dict(hidden_size=HIDDEN, num_heads=2, use_gate=True)),
    LayerCase("deltanet_sum", "DeltaNet",
              dict(hidden_size=HIDDEN, num_heads=2, qk_activation="elu", qk_norm="sum",
                   use_beta=False, conv_bias=True)),
    LayerCase("gla", "GatedLinearAttention",
              dict(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, use_short_conv=True)),
    LayerCase("gsa", "GatedSlotAttention",
              dict(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, num_slots=12,
                   use_short_conv=True)),
    LayerCase("retention", "MultiScaleRetention",
              dict(hidden_size=HIDDEN, num_heads=2, num_kv_heads=1, use_short_conv=True)),
    LayerCase("linear_attn", "LinearAttention",
              dict(hidden_size=HIDDEN, num_heads=2, feature_map="elu", do_feature_map_norm=True)),
    LayerCase("rwkv7", "RWKV7Attention",
              dict(hidden_size=HIDDEN, head_dim=8, layer_idx=0, decay_low_rank_dim=8,
                   gate_low_rank_dim=8, a_low_rank_dim=8), perturb=0.3),
    LayerCase("kda", "KimiDeltaAttention",
              dict(hidden_size=HIDDEN, head_dim=8, num_heads=2, num_v_heads=4)),
)}
NAMES = tuple(CASES)
FRAMEWORKS = ("torch", "jax")
T = 70                # the padded length: crosses one 64-token chunk
LENGTHS = (70, 45)    # real tokens per row (row 1 padded by 25)
N_DECODE = 3
TOL = LAYER_TOLERANCE["fp32"]["o"]


def _tokens():
    """Real tokens per row [L + N_DECODE, hidden] and the padding filler (random, not 0)."""
    rng = np.random.default_rng(7)
    real = [rng.standard_normal((n + N_DECODE, HIDDEN)) for n in LENGTHS]
    filler = rng.standard_normal((len(LENGTHS), T, HIDDEN)) * 3.0
    return real, filler


def padded_batch(side: str):
    """x [B, T, hidden], mask int64 [B, T] with each row's first L real tokens on `side`
    ('left', 'right', or 'inner': the first half at the start, the rest at the end)."""
    real, filler = _tokens()
    x, mask = filler.copy(), np.zeros((len(LENGTHS), T), np.int64)
    for b, n in enumerate(LENGTHS):
        cols = {"left": np.arange(T - n, T), "right": np.arange(n),
                "inner": np.r_[np.arange(n // 2), np.arange(T - (n - n // 2), T)]}[side]
        x[b, cols], mask[b, cols] = real[b][:n], 1
    return x, mask


@functools.lru_cache(maxsize=None)
def _layers(name: str):
    case = CASES[name]
    tl = make_torch_layer(case)
    sd = tinterop.to_numpy(tl)
    jl = make_jax_layer(case, sd)
    graphdef, state = nnx.split(jl)

    @jax.jit
    def jax_fwd(state, x, mask, cache):
        o, _, c = nnx.merge(graphdef, state)(x, attention_mask=mask, past_key_values=cache,
                                              use_cache=True)[:3]
        return o, c

    return tl, (lambda x, mask, cache: jax_fwd(state, x, mask, cache))


def run(fw: str, name: str, x, mask=None, cache=None):
    """One call with use_cache=True -> (o float64 numpy, raw cache)."""
    tl, jax_fwd = _layers(name)
    if fw == "torch":
        with torch.no_grad():
            o, _, c = tl(torch.tensor(x, dtype=torch.float32),
                         attention_mask=None if mask is None else torch.tensor(mask),
                         past_key_values=cache, use_cache=True)[:3]
        return o.double().numpy(), c
    o, c = jax_fwd(jnp.asarray(x, jnp.float32), None if mask is None else jnp.asarray(mask),
                   cache)
    return np.asarray(o, np.float64), c


def cache_np(cache, rows=None) -> dict:
    """Cache dict -> float64 numpy arrays (rows: keep these batch rows)."""
    state = cache["recurrent_state"]
    out = {f"recurrent_state{i or ''}": np.asarray(part, np.float64)   # GSA: (hk, hv)
           for i, part in enumerate(state if isinstance(state, tuple) else (state,))}
    for i, c in enumerate(cache.get("conv_state") or ()):
        out[f"conv_state[{i}]"] = np.asarray(c, np.float64)
    if "k_sum" in cache:
        out["k_sum"] = np.asarray(cache["k_sum"], np.float64)
    if cache.get("shift_state") is not None:       # RWKV-7's token shift
        out["shift_state"] = np.asarray(cache["shift_state"], np.float64)
    out["offset"] = np.broadcast_to(np.asarray(cache["offset"], np.int64),
                                    out["recurrent_state"].shape[:1]).copy()
    if rows is not None:
        out = {k: v[rows] for k, v in out.items()}
    return out


def assert_close(got: dict, want: dict, what: str):
    assert set(got) == set(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    bad = []
    for k in want:
        if k == "offset":
            if not np.array_equal(got[k], want[k]):
                bad.append(f"offset {got[k]} != {want[k]}")
            continue
        err = rel_rms(got[k], want[k], want[k])
        if not err <= TOL:
            bad.append(f"{k}: {err:.2e} > {TOL:.0e}")
    assert not bad, f"{what}: " + "; ".join(bad)


@functools.lru_cache(maxsize=None)
def alone(fw: str, name: str, b: int, n: int):
    """Row b's first n real tokens run alone, unpadded: (o [n, hidden], cache as numpy)."""
    real, _ = _tokens()
    o, c = run(fw, name, real[b][None, :n])
    return o[0], cache_np(c)


@functools.lru_cache(maxsize=None)
def padded(fw: str, name: str, side: str):
    x, mask = padded_batch(side)
    o, c = run(fw, name, x, mask)
    return o, c


@pytest.mark.parametrize("side", ("left", "right", "inner"))
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_equals_sequences_alone(name, fw, side):
    o, c = padded(fw, name, side)
    _, mask = padded_batch(side)
    assert np.all(o[mask == 0] == 0), "outputs at padded positions are not 0"
    for b, n in enumerate(LENGTHS):
        o_ref, c_ref = alone(fw, name, b, n)
        got = {"o": o[b][mask[b] == 1], **cache_np(c, rows=[b])}
        want = {"o": o_ref, **{k: v[:1] for k, v in c_ref.items()}}
        assert_close(got, want, f"{name} {fw} {side}-padded row {b} (length {n})")


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_decode_after_left_padded_prefill(name, fw):
    """Left-padded prefill (chunk mode), N_DECODE single tokens with a mask of ones (the
    recurrent path), then one step where row 1 is padding: == each sequence run alone."""
    real, _ = _tokens()
    _, cache = padded(fw, name, "left")
    outs = []
    for i in range(N_DECODE):
        xs = np.stack([r[n + i] for r, n in zip(real, LENGTHS)])[:, None]
        o, cache = run(fw, name, xs, np.ones((len(LENGTHS), 1), np.int64), cache)
        outs.append(o)
    outs = np.concatenate(outs, 1)
    for b, n in enumerate(LENGTHS):
        o_ref, c_ref = alone(fw, name, b, n + N_DECODE)
        got = {"o": outs[b], **cache_np(cache, rows=[b])}
        want = {"o": o_ref[n:], **c_ref}
        assert_close(got, want, f"{name} {fw} decode row {b}")
    # a step where row 1 is padding: row 1's cache does not move, row 0 decodes on
    before = cache_np(cache)
    rng = np.random.default_rng(3)
    o, cache = run(fw, name, rng.standard_normal((len(LENGTHS), 1, HIDDEN)),
                   np.array([[1], [0]]), cache)
    after = cache_np(cache)
    assert np.all(o[1] == 0)
    for k in before:
        if k == "offset":
            assert list(after[k]) == [before[k][0] + 1, before[k][1]]
        else:
            assert np.array_equal(after[k][1], before[k][1]), f"{name} {fw}: padded step moved {k}"
            assert not np.array_equal(after[k][0], before[k][0]), f"{name} {fw}: {k} stuck"


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", ("gdn", "deltanet", "gla", "gsa", "retention", "linear_attn",
                                  "rwkv7", "kda"))
def test_fused_recurrent_mode_left_padded(name, fw):
    """A layer built with mode='fused_recurrent' (same seed, same weights) on the left-padded
    batch == the chunk-mode layer on each sequence alone."""
    case = CASES[name]
    case = dataclasses.replace(case, kwargs={**case.kwargs, "mode": "fused_recurrent"})
    tl = make_torch_layer(case)
    x, mask = padded_batch("left")
    if fw == "torch":
        with torch.no_grad():
            o, _, c = tl(torch.tensor(x, dtype=torch.float32), attention_mask=torch.tensor(mask),
                         use_cache=True)[:3]
        o = o.double().numpy()
    else:
        jl = make_jax_layer(case, tinterop.to_numpy(tl))
        o, _, c = nnx.jit(lambda m, x, mask: m(x, attention_mask=mask, use_cache=True)[:3])(
            jl, jnp.asarray(x, jnp.float32), jnp.asarray(mask))
        o = np.asarray(o, np.float64)
    for b, n in enumerate(LENGTHS):
        o_ref, c_ref = alone(fw, name, b, n)
        assert_close({"o": o[b][mask[b] == 1], **cache_np(c, rows=[b])}, {"o": o_ref, **c_ref},
                     f"{name} {fw} fused_recurrent left-padded row {b}")


# ----------------------------------------------------------------------------- torch vs jax

def _grads_torch(name, x, mask, dy):
    tl, _ = _layers(name)
    tl.zero_grad(set_to_none=True)
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    o = tl(xt, attention_mask=torch.tensor(mask))[0]
    o.backward(torch.tensor(dy, dtype=torch.float32))
    out = {"o": o.detach().double().numpy(), "dx": xt.grad.double().numpy()}
    out.update({"d:" + k: p.grad.double().numpy() for k, p in tl.named_parameters()})
    return out


def _grads_jax(name, x, mask, dy):
    from fla_jax.interop import to_state_dict
    case = CASES[name]
    jl = make_jax_layer(case, tinterop.to_numpy(_layers(name)[0]))
    graphdef, params, rest = nnx.split(jl, nnx.Param, ...)

    @jax.jit
    def grads(params, x, mask):
        def loss(params, x):
            o = nnx.merge(graphdef, params, rest)(x, attention_mask=mask)[0]
            return jnp.sum(o * jnp.asarray(dy, jnp.float32)), o
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    (_, o), (dp, dx) = grads(params, jnp.asarray(x, jnp.float32), jnp.asarray(mask))
    out = {"o": np.asarray(o, np.float64), "dx": np.asarray(dx, np.float64)}
    out.update({"d:" + k: np.asarray(v, np.float64)
                for k, v in to_state_dict(nnx.merge(graphdef, dp, rest)).items()})
    return out


@pytest.mark.parametrize("name", NAMES)
def test_padded_parity_torch_jax(name):
    """Same weights, same left-padded batch: outputs, caches, dx and parameter gradients."""
    o_t, c_t = padded("torch", name, "left")
    o_j, c_j = padded("jax", name, "left")
    assert_close({"o": o_j, **cache_np(c_j)}, {"o": o_t, **cache_np(c_t)},
                 f"{name} jax vs torch (forward, cache)")
    x, mask = padded_batch("left")
    dy = np.random.default_rng(5).standard_normal(x.shape)
    gt, gj = _grads_torch(name, x, mask, dy), _grads_jax(name, x, mask, dy)
    assert all(np.isfinite(v).all() for v in gt.values())
    assert np.all(gt["dx"][mask == 0] == 0), "padded inputs got a gradient"
    gj = {k: v for k, v in gj.items() if k in gt}      # tied feature maps: torch lists once
    bad = [f"{k}: {rel_rms(gj[k], gt[k], gt[k]):.2e}" for k in gt
           if not rel_rms(gj[k], gt[k], gt[k]) <= LAYER_TOLERANCE["fp32"]["grad"]]
    assert not bad, f"{name} jax vs torch gradients: " + "; ".join(bad)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_mask_dtypes_agree(fw):
    """bool, integer and float masks give the same result."""
    x, mask = padded_batch("left")
    x, mask = x[:, -12:], mask[:, -12:]
    ref, _ = run(fw, "gdn", x, mask.astype(bool))
    for dt in (np.int32, np.float32):
        o, _ = run(fw, "gdn", x, mask.astype(dt))
        assert np.array_equal(o, ref), dt


def _call(fw, name, x, mask, **kw):
    tl, _ = _layers(name)
    if fw == "torch":
        return tl(torch.tensor(x, dtype=torch.float32), attention_mask=mask, **kw)
    jl = make_jax_layer(CASES[name], tinterop.to_numpy(tl))
    return jl(jnp.asarray(x, jnp.float32), attention_mask=mask, **kw)


def _arr(fw, a):
    return torch.tensor(a) if fw == "torch" else jnp.asarray(a)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("name", ("gdn", "retention"))
def test_mask_errors(name, fw):
    cls = CASES[name].cls
    x = np.random.default_rng(0).standard_normal((2, 5, HIDDEN))
    with pytest.raises(ValueError, match=rf"{cls}: attention_mask has shape \[2, 4\]; "
                                         rf"expected \[B, T\] = \[2, 5\]"):
        _call(fw, name, x, _arr(fw, np.ones((2, 4), np.int64)))
    with pytest.raises(ValueError, match=rf"{cls}: attention_mask has shape \[5\]"):
        _call(fw, name, x, _arr(fw, np.ones((5,), np.int64)))
    with pytest.raises(ValueError, match=rf"{cls}: attention_mask has the value 2"):
        _call(fw, name, x, _arr(fw, np.full((2, 5), 2, np.int64)))
    with pytest.raises(ValueError, match=rf"{cls}: attention_mask has the value 0.5"):
        _call(fw, name, x, _arr(fw, np.full((2, 5), 0.5, np.float32)))
    cu = _arr(fw, np.array([0, 2, 5], np.int32))
    with pytest.raises(ValueError, match=rf"{cls}: attention_mask and cu_seqlens"):
        _call(fw, name, x[:1], _arr(fw, np.ones((1, 5), np.int64)), cu_seqlens=cu)
    if fw == "torch":
        with pytest.raises(TypeError, match=rf"{cls}: attention_mask is list"):
            _call(fw, name, x, [[1] * 5] * 2)


def test_mask_values_not_checked_under_jit():
    """Under a JAX trace the mask's values are unknown: no check, no error (shape still is)."""
    tl, _ = _layers("gdn")
    jl = make_jax_layer(CASES["gdn"], tinterop.to_numpy(tl))
    graphdef, state = nnx.split(jl)

    @jax.jit
    def fwd(state, x, mask):
        return nnx.merge(graphdef, state)(x, attention_mask=mask)[0]

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, HIDDEN)), jnp.float32)
    fwd(state, x, jnp.ones((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="GatedDeltaNet: attention_mask has shape"):
        fwd(state, x, jnp.ones((2, 4), jnp.int32))
