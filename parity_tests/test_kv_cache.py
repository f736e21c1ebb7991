"""The Attention layer's preallocated KV cache (fla_contract/kv_cache.py), both frameworks:

- a jitted JAX decode step of the hybrid LM (Gated DeltaNet recurrent caches + an Attention KV
  cache in one pytree) traces ONCE over 10 steps, keeps the cache's structure, shapes and
  dtypes, and its token-by-token logits == one full forward (torch too);
- left padding + a window + GQA through prefill, a multi-token cached chunk and single tokens
  == one padded forward (jax under jit), fla_jax == fla_torch, caches equal;
- a call past capacity raises the named ValueError (eager, both frameworks); under jit the
  step's outputs are NaN; max_cache_len is checked;
- attention_with_key_mask(q_offset=L) over a buffer of S slots == the plain call over the
  first L + T slots (the op both layers use).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from fla_jax.ops.attention.interface import attention_with_key_mask as j_attn  # noqa: E402
from fla_torch.ops.attention.interface import attention_with_key_mask as t_attn  # noqa: E402

from .cases import CROSS_FACTOR, LAYER_TOLERANCE, rel_rms  # noqa: E402
from .test_attention_layer import _pair  # noqa: E402
from .test_models import TOL_DECODE, VOCAB, make_pair  # noqa: E402

TOL = LAYER_TOLERANCE["fp32"]["o"]


def test_hybrid_jitted_decode_traces_once():
    """Prefill (max_cache_len = prompt + 10) then 10 jitted one-token steps: one trace, the
    same cache treedef / shapes / dtypes every step, logits == one full forward (both
    frameworks, fp32)."""
    t_model, j_model, _ = make_pair("hybrid")
    P, N = 7, 10
    x = np.random.default_rng(3).integers(0, VOCAB, (2, P + N))
    with torch.no_grad():
        full_t = t_model(torch.from_numpy(x)).numpy()
    full_j = np.asarray(j_model(jnp.asarray(x)))
    traces = []

    @nnx.jit
    def step(model, token, cache):
        traces.append(1)          # runs only while tracing
        return model(token, cache=cache, use_cache=True)

    logits, cache = j_model(jnp.asarray(x[:, :P]), use_cache=True, max_cache_len=P + N)
    kv = cache[1]
    assert kv["attn_state"][0].shape[1] == P + N and "recurrent_state" in cache[0]

    def signature(c):
        leaves, tree = jax.tree_util.tree_flatten(c)
        return tree, [(jnp.shape(a), jnp.result_type(a)) for a in leaves]

    first = None
    outs = [np.asarray(logits)]
    for t in range(P, P + N):
        logits, cache = step(j_model, jnp.asarray(x[:, t:t + 1]), cache)
        outs.append(np.asarray(logits))
        first = first or signature(cache)
        assert signature(cache) == first
    assert len(traces) == 1, f"the decode step traced {len(traces)} times over {N} steps"
    stepped = np.concatenate(outs, 1)[:, :P + N]
    assert rel_rms(stepped, full_j, full_j) <= TOL_DECODE
    assert int(cache[1]["length"]) == P + N

    with torch.no_grad():
        lt, ct = t_model(torch.from_numpy(x[:, :P]), use_cache=True, max_cache_len=P + N)
        outs_t = [lt.numpy()]
        for t in range(P, P + N):
            lt, ct = t_model(torch.from_numpy(x[:, t:t + 1]), cache=ct, use_cache=True)
            outs_t.append(lt.numpy())
    assert rel_rms(np.concatenate(outs_t, 1), full_t, full_t) <= TOL_DECODE
    assert ct[1]["length"] == P + N
    for a, b in zip(ct[1]["attn_state"], cache[1]["attn_state"]):
        assert rel_rms(np.asarray(b), a.numpy(), a.numpy()) <= TOL_DECODE * CROSS_FACTOR
    assert np.array_equal(ct[1]["attn_mask"].numpy(), np.asarray(cache[1]["attn_mask"]))


def test_padding_window_gqa_decode():
    """Left-padded rows, window 4, GQA (4 q heads, 2 kv heads): prefill 6, a cached chunk of
    5, then one token at a time == one padded forward; jax under jit (the one-token step
    traced once), fla_jax == fla_torch, final caches equal."""
    tl, jl = _pair(window_size=4)
    B, T, P, C = 3, 19, 6, 5
    x = np.random.default_rng(4).standard_normal((B, T, 32))
    m = np.ones((B, T), np.int64)
    m[0, :4] = 0
    m[1, :1] = 0
    xt, mt = torch.tensor(x, dtype=torch.float32), torch.tensor(m)
    splits = [(0, P), (P, P + C)] + [(t, t + 1) for t in range(P + C, T)]
    with torch.no_grad():
        full = tl(xt, attention_mask=mt)[0].numpy()
        outs, c = [], None
        for a, b in splits:
            o, _, c = tl(xt[:, a:b], attention_mask=mt[:, a:b], past_key_values=c,
                         use_cache=True, **({"max_cache_len": T} if a == 0 else {}))
            outs.append(o)
    assert rel_rms(torch.cat(outs, 1).numpy(), full, full) <= TOL
    assert np.all(full[0, :4] == 0)

    traces = []

    @nnx.jit
    def step(layer, xs, ms, cache):
        traces.append(xs.shape[1])
        o, _, cache = layer(xs, attention_mask=ms, past_key_values=cache, use_cache=True)
        return o, cache

    xj, mj = jnp.asarray(x, jnp.float32), jnp.asarray(m)
    o, _, cj = jl(xj[:, :P], attention_mask=mj[:, :P], use_cache=True, max_cache_len=T)
    outs = [o]
    for a, b in splits[1:]:
        o, cj = step(jl, xj[:, a:b], mj[:, a:b], cj)
        outs.append(o)
    assert traces == [C, 1], traces
    sj = np.asarray(jnp.concatenate(outs, 1))
    assert rel_rms(sj, full, full) <= TOL * CROSS_FACTOR
    assert np.array_equal(np.asarray(cj["attn_mask"]), c["attn_mask"].numpy())
    assert np.asarray(cj["offset"]).tolist() == c["offset"].tolist() == m.sum(1).tolist()
    for a, b in zip(c["attn_state"], cj["attn_state"]):
        assert rel_rms(np.asarray(b), a.numpy(), a.numpy()) <= TOL * CROSS_FACTOR


def test_capacity_exceeded_raises():
    """length + T > capacity: the named ValueError in both frameworks (eager); under jit the
    step returns NaN; max_cache_len < T, a mismatching max_cache_len and max_cache_len without
    use_cache raise ValueError."""
    tl, jl = _pair()
    x = np.random.default_rng(5).standard_normal((2, 6, 32))
    xt, xj = torch.tensor(x, dtype=torch.float32), jnp.asarray(x, jnp.float32)
    with torch.no_grad():
        _, _, ct = tl(xt[:, :4], use_cache=True, max_cache_len=5)
        _, _, ct = tl(xt[:, 4:5], past_key_values=ct, use_cache=True)
        with pytest.raises(ValueError, match=r"KV cache full.*5 of 5 slots.*max_cache_len"):
            tl(xt[:, 5:6], past_key_values=ct, use_cache=True)
        with pytest.raises(ValueError, match="max_cache_len=3 is smaller than the T=4"):
            tl(xt[:, :4], use_cache=True, max_cache_len=3)
        with pytest.raises(ValueError, match="capacity 5"):
            tl(xt[:, 5:6], past_key_values=ct, use_cache=True, max_cache_len=8)
        with pytest.raises(ValueError, match="use_cache=False"):
            tl(xt, max_cache_len=8)
    _, _, cj = jl(xj[:, :4], use_cache=True, max_cache_len=5)
    _, _, cj = jl(xj[:, 4:5], past_key_values=cj, use_cache=True)
    with pytest.raises(ValueError, match=r"KV cache full.*5 of 5 slots.*max_cache_len"):
        jl(xj[:, 5:6], past_key_values=cj, use_cache=True)
    with pytest.raises(ValueError, match="max_cache_len=3 is smaller than the T=4"):
        jl(xj[:, :4], use_cache=True, max_cache_len=3)
    with pytest.raises(ValueError, match="capacity 5"):
        jl(xj[:, 5:6], past_key_values=cj, use_cache=True, max_cache_len=8)
    with pytest.raises(ValueError, match="use_cache=False"):
        jl(xj, max_cache_len=8)

    @nnx.jit
    def step(layer, xs, cache):
        o, _, cache = layer(xs, past_key_values=cache, use_cache=True)
        return o, cache

    o, cj2 = step(jl, xj[:, 5:6], cj)
    assert np.all(np.isnan(np.asarray(o))) and int(cj2["length"]) == 6
    _, _, fresh = jl(xj[:, :4], use_cache=True, max_cache_len=6)
    o, _ = step(jl, xj[:, 4:6], fresh)
    assert not np.any(np.isnan(np.asarray(o)))


@pytest.mark.parametrize("window", [None, 3])
def test_q_offset_equals_sliced_call(window):
    """Query t at slot L + t of an S-slot buffer (later slots garbage, key_mask False) == the
    bottom-right call over the first L + T slots; jax with L traced; both frameworks."""
    rng = np.random.default_rng(6)
    B, S, L, T, HQ, HKV, D = 2, 16, 7, 3, 4, 2, 8
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, HKV, D)).astype(np.float32) for _ in range(2))
    km = np.zeros((B, S), bool)
    km[:, :L + T] = True
    km[0, :2] = False
    n = L + T
    ref = t_attn(*(torch.from_numpy(a) for a in (q, k[:, :n], v[:, :n], km[:, :n])),
                 window_size=window, impl="reference").numpy()
    for impl in ("reference", "sdpa"):
        got = t_attn(*(torch.from_numpy(a) for a in (q, k, v, km)), window_size=window,
                     impl=impl, q_offset=L).numpy()
        assert rel_rms(got, ref, ref) <= TOL, impl
    f = jax.jit(lambda L: j_attn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                 jnp.asarray(km), window_size=window, q_offset=L))
    got = np.asarray(f(jnp.asarray(L, jnp.int32)))
    assert rel_rms(got, ref, ref) <= TOL * CROSS_FACTOR
