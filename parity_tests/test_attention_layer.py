"""The Attention layer beyond test_layers.py: padding masks, packed sequences, and the
incidents of issue 13 (shared/dtype-lessons.md 4 and 5) as tests -- fp32 parameters with
fp16/bf16 activations through q/k normalisation (learned fp32 scales) into softmax attention,
with and without torch.autocast: nothing promoted, forward and backward run; a q/k/v dtype mix
raises the contract's TypeError naming the odd tensor."""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import fla_jax.layers as jlayers  # noqa: E402
import fla_torch.layers as tlayers  # noqa: E402
from fla_jax import interop as jinterop  # noqa: E402
from fla_torch import interop as tinterop  # noqa: E402

from .cases import CROSS_FACTOR, LAYER_TOLERANCE, rel_rms  # noqa: E402

KW = dict(hidden_size=32, num_heads=4, num_kv_heads=2, qk_norm=True)
TOL = LAYER_TOLERANCE["fp32"]["o"]


def _pair(**kw):
    torch.manual_seed(0)
    tl = tlayers.Attention(**dict(KW, **kw))
    with torch.no_grad():
        for name, p in tl.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    jl = jlayers.Attention(**dict(KW, **kw), rngs=nnx.Rngs(0))
    jinterop.from_state_dict(jl, tinterop.to_numpy(tl))
    return tl, jl


def _masks(B: int, T: int) -> np.ndarray:
    """Row 0 left-padded (4), row 1 right-padded (3), row 2 inner padding (2), row 3 none."""
    m = np.ones((B, T), np.int64)
    m[0, :4] = 0
    m[1, -3:] = 0
    m[2, 5:7] = 0
    return m


@pytest.mark.parametrize("window", [None, 6])
def test_padding_equals_each_row_alone(window):
    """attention_mask: each row's real tokens give what the unpadded row gives (rotary positions
    count real tokens; a window counts slots, so inner/right padding is checked without one);
    padded positions output 0; fla_jax == fla_torch."""
    tl, jl = _pair(window_size=window)
    B, T = 4, 23
    x = np.random.default_rng(0).standard_normal((B, T, 32))
    m = _masks(B, T)
    with torch.no_grad():
        ot = tl(torch.tensor(x, dtype=torch.float32), attention_mask=torch.tensor(m))[0].numpy()
    oj = np.asarray(jl(jnp.asarray(x, jnp.float32), attention_mask=jnp.asarray(m))[0])
    assert rel_rms(oj, ot, ot) <= TOL * CROSS_FACTOR
    rows = (0, 3) if window else range(B)
    for b in rows:
        keep = m[b].astype(bool)
        with torch.no_grad():
            alone = tl(torch.tensor(x[b:b + 1, keep], dtype=torch.float32))[0].numpy()[0]
        assert rel_rms(ot[b, keep], alone, alone) <= TOL, f"row {b}"
        assert np.all(ot[b, ~keep] == 0) and np.all(oj[b, ~keep] == 0)


def test_padded_prefill_then_decode():
    """A left-padded batch: prefill with attention_mask, then token by token (mask ones)
    through the KV cache == one padded forward, in both frameworks (jax under jit)."""
    tl, jl = _pair()
    B, T, P = 2, 20, 9
    x = np.random.default_rng(1).standard_normal((B, T, 32))
    m = np.ones((B, T), np.int64)
    m[0, :3] = 0
    xt = torch.tensor(x, dtype=torch.float32)
    with torch.no_grad():
        full = tl(xt, attention_mask=torch.tensor(m))[0].numpy()
        o, _, c = tl(xt[:, :P], attention_mask=torch.tensor(m[:, :P]), use_cache=True)
        outs = [o]
        for t in range(P, T):
            o, _, c = tl(xt[:, t:t + 1], attention_mask=torch.tensor(m[:, t:t + 1]),
                         past_key_values=c, use_cache=True)
            outs.append(o)
    stepped = torch.cat(outs, 1).numpy()
    assert rel_rms(stepped, full, full) <= TOL
    S = 256 * -(-(P + 256) // 256)      # default capacity: prefill + 256, to a multiple of 256
    assert c["attn_state"][0].shape == (B, S, 2, 8) and c["attn_mask"].shape == (B, S)
    assert c["length"] == T
    assert c["offset"].tolist() == m.sum(1).tolist()

    graphdef, state = nnx.split(jl)

    @jax.jit
    def step(state, xs, ms, cache):
        o, _, cache = nnx.merge(graphdef, state)(xs, attention_mask=ms, past_key_values=cache,
                                                use_cache=True)
        return o, cache

    xj = jnp.asarray(x, jnp.float32)
    o, c = step(state, xj[:, :P], jnp.asarray(m[:, :P]), None)
    outs = [o]
    for t in range(P, T):
        o, c = step(state, xj[:, t:t + 1], jnp.asarray(m[:, t:t + 1]), c)
        outs.append(o)
    sj = np.asarray(jnp.concatenate(outs, 1))
    assert rel_rms(sj, full, full) <= TOL * CROSS_FACTOR


def test_packed_sequences_and_no_packed_cache():
    """cu_seqlens (B == 1): packed == each sequence alone (an empty one included), both
    frameworks; use_cache with cu_seqlens raises ValueError (the KV cache holds padded rows)."""
    tl, jl = _pair(window_size=5)
    cu = (0, 5, 5, 19, 30)
    x = np.random.default_rng(2).standard_normal((1, cu[-1], 32))
    xt = torch.tensor(x, dtype=torch.float32)
    with torch.no_grad():
        packed = tl(xt, cu_seqlens=torch.tensor(cu))[0].numpy()
        alone = np.concatenate([tl(xt[:, a:b])[0].numpy() for a, b in zip(cu[:-1], cu[1:])
                                if b > a], 1)
    assert rel_rms(packed, alone, alone) <= TOL
    pj = jax.jit(lambda cu: jl(jnp.asarray(x, jnp.float32), cu_seqlens=cu)[0])(
        jnp.asarray(cu, jnp.int32))
    assert rel_rms(np.asarray(pj), packed, packed) <= TOL * CROSS_FACTOR
    with pytest.raises(ValueError, match="cu_seqlens"):
        tl(xt, cu_seqlens=torch.tensor(cu), use_cache=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        jl(jnp.asarray(x, jnp.float32), cu_seqlens=jnp.asarray(cu, jnp.int32), use_cache=True)


# ----------------------------------------------------------------------------- incidents

def _spy_torch(monkeypatch):
    """Record the q/k/v dtypes that reach the attention op from the layer."""
    import fla_torch.layers.attn as mod
    seen = []
    for name in ("attention", "attention_with_key_mask"):
        real = getattr(mod, name)

        def spy(q, k, v, *a, _real=real, **kw):
            seen.append((q.dtype, k.dtype, v.dtype))
            return _real(q, k, v, *a, **kw)
        monkeypatch.setattr(mod, name, spy)
    return seen


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True])
def test_fp32_params_half_activations_torch(dtype, masked, monkeypatch):
    """Incident 4: fp32 parameters (projections, the q/k RMSNorm scales) with fp16/bf16
    activations. q, k, v reach the op in the activation dtype (the fp32 norm scales promote
    nothing); output and dx in that dtype, parameter gradients fp32; forward + backward run."""
    seen = _spy_torch(monkeypatch)
    tl, _ = _pair()
    td = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    x = torch.randn(2, 13, 32).to(td).requires_grad_(True)
    m = torch.tensor(_masks(4, 13)[:2]) if masked else None
    o = tl(x, attention_mask=m)[0]
    o.float().square().sum().backward()
    assert seen and all(d == (td, td, td) for d in seen), seen
    assert o.dtype == td and x.grad.dtype == td and torch.isfinite(x.grad.float()).all()
    for name, p in tl.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name


def test_autocast_promotes_nothing(monkeypatch):
    """Incident 4 under torch.autocast(bf16) with fp32 inputs and parameters: the layer
    computes in bf16, q/k/v reach the op as bf16 (the fp32 q/k norm scales do not lift them to
    fp32), forward + backward run, gradients in the parameters' fp32."""
    seen = _spy_torch(monkeypatch)
    tl, _ = _pair()
    x = torch.randn(2, 13, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = tl(x)[0]
        loss = o.float().square().sum()
    loss.backward()
    assert seen == [(torch.bfloat16,) * 3]
    assert o.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in tl.parameters())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fp32_params_half_activations_jax(dtype):
    """Incident 4 in fla_jax: fp32 parameters with fp16/bf16 activations through q/k RMSNorm
    and the op: output and dx in the activation dtype, parameter gradients fp32, finite."""
    _, jl = _pair()
    jd = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype]
    graphdef, params = nnx.split(jl, nnx.Param)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 13, 32)), jd)

    def loss(params, x):
        o = nnx.merge(graphdef, params)(x)[0]
        return jnp.sum(jnp.square(o.astype(jnp.float32))), o

    (_, o), (dp, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    assert o.dtype == jd and dx.dtype == jd and bool(jnp.isfinite(dx.astype(jnp.float32)).all())
    for leaf in jax.tree_util.tree_leaves(dp):
        assert leaf.dtype == jnp.float32 and bool(jnp.isfinite(leaf).all())


def test_scaled_q_mix_is_the_named_type_error():
    """Incident 5 / 4: an fp32 learned scale multiplied into bf16 q (torch promotes q to
    fp32) then handed to attention: the contract's TypeError names q, both frameworks;
    never a cast, never "only fp16/bf16"."""
    from fla_jax.ops import attention as jattention
    from fla_torch.ops import attention as tattention
    q, k, v = (torch.randn(1, 9, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    scale = torch.nn.Parameter(torch.ones(16))           # fp32, per channel
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype.*q=float32.*\(q differs\)"):
        tattention(q * scale, k, v)
    with pytest.raises(TypeError, match=r"k=float32.*\(k differs\)"):
        tattention(q, torch.nn.functional.normalize(k.float(), dim=-1), v)
    qj, kj, vj = (jnp.asarray(t.float().numpy(), jnp.bfloat16) for t in (q, k, v))
    with pytest.raises(TypeError, match=r"q=float32.*\(q differs\)"):
        jattention(qj * jnp.ones(16, jnp.float32), kj, vj)
    for fn, arr in ((tattention, torch.randn(1, 9, 2, 16)), (jattention, jnp.ones((1, 9, 2, 16)))):
        assert fn(arr, arr, arr).dtype == arr.dtype      # fp32 accepted by every auto path


def test_parity_rows_catch_an_off_by_one_window(monkeypatch):
    """The attention parity rows can fail: an SDPA path whose window reaches one key further
    than asked fails the fp32 check of the 'attn_window' case."""
    from fla_torch.ops.attention import engine, interface

    from .harness import check

    def wide(q, k, v, *, window, **kw):
        left, right = window
        return engine.attention_sdpa(q, k, v, window=(left + 1, right), **kw)
    monkeypatch.setitem(interface.IMPLS, "sdpa", wide)
    rows = check("attention", "attn_window", "fp32", {"torch": "auto"})
    assert any(not r.passed for r in rows if r.tensor == "o")


def test_jax_auto_on_gpu_picks_cudnn_and_falls_back_to_xla(monkeypatch):
    """impl='auto' as on a GPU (on_gpu patched): bf16 plain causal goes to the cuDNN path;
    jax's cuDNN wrapper refusing the call while tracing (here: no cuDNN on this machine) runs
    the XLA path, same result; explicit impl='cudnn' raises instead; fp32 / a window with a
    right side / packed sequences go to XLA directly."""
    from fla_jax.ops import attention
    from fla_jax.ops.attention import engine, interface
    monkeypatch.setattr(interface, "on_gpu", lambda: True)
    chosen = []
    real = interface._auto
    monkeypatch.setattr(interface, "_auto", lambda q, call: chosen.append(real(q, call)) or
                        chosen[-1])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 20, 2, 16)), jnp.bfloat16) for _ in range(3))
    o = attention(q, k, v)
    ref = attention(q, k, v, impl="xla")
    assert chosen == ["cudnn"] and o.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(o, np.float32), np.asarray(ref, np.float32))
    with pytest.raises(RuntimeError):
        engine.attention_cudnn(q, k, v, scale=0.25, causal=True, window=None)
    attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    attention(q, k, v, causal=False, window_size=(3, 2))
    attention(q, k, v, cu_seqlens=jnp.asarray([0, 7, 20], jnp.int32))
    assert chosen[1:] == ["xla", "xla", "xla"]


def test_op_argument_errors_same_words_both_frameworks():
    """Bad attention arguments raise the same TypeError / ValueError text in both frameworks,
    naming the argument, what was given and what is expected."""
    from fla_jax.ops import attention as ja
    from fla_torch.ops import attention as ta

    def arrays(fw, *shapes):
        return [torch.ones(*s) if fw == "torch" else jnp.ones(s) for s in shapes]
    cases = [
        (((1, 9, 4, 8), (1, 9, 3, 8), (1, 9, 3, 8)), {}, ValueError, "HQ % HKV == 0"),
        (((1, 9, 4, 8), (1, 5, 2, 8), (1, 5, 2, 8)), {}, ValueError, "expected S >= T"),
        (((1, 9, 2, 8), (1, 9, 2, 8), (1, 7, 2, 8)), {}, ValueError,
         "v has shape [1, 7, 2, 8]; expected batch, key length and key/value heads of k"),
        (((1, 9, 2, 8),) * 3, {"window_size": 0}, ValueError, "window_size=0"),
        (((1, 9, 2, 8),) * 3, {"window_size": (2, -3)}, ValueError, "right=-3"),
        (((1, 9, 2, 8),) * 3, {"window_size": 2.5}, TypeError, "window_size is float"),
        (((1, 9, 2, 8),) * 3, {"causal": None}, TypeError, "causal is NoneType"),
        (((2, 9, 2, 8),) * 3, {"cu_seqlens": [0, 9]}, TypeError, "cu_seqlens is a list"),
    ]
    for shapes, kw, exc, words in cases:
        msgs = []
        for fw, fn in (("torch", ta), ("jax", ja)):
            with pytest.raises(exc) as info:
                fn(*arrays(fw, *shapes), **kw)
            assert words in str(info.value), (fw, str(info.value))
            msgs.append(str(info.value).split("; expected a torch")[0].split("; expected a jax")[0])
        assert msgs[0] == msgs[1], msgs
