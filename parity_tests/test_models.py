"""The tiny causal LM (fla_torch.models / fla_jax.models) across frameworks.

- forward parity: the same weights (drawn in torch, loaded into Flax) give the same logits in
  fp32 (each framework vs the torch model in float64: rel RMS < 1e-5) and in bf16 compute;
- recurrent decoding (prefill + one token at a time with the cache) == one full forward;
- the LM's weights round-trip torch -> Flax -> torch bit for bit (in memory and through
  safetensors files), tied and untied heads;
- three AdamW steps (torch.optim vs optax) from the same weights on the same batches give the
  same losses and parameters; a 3% learning-rate error fails the same tolerance.
Small sizes (CPU, a few seconds per case).
"""
from __future__ import annotations

import numpy as np
import pytest

import torch  # noqa: E402  (the suite needs every framework: no silent skip)
import jax  # noqa: E402  (the suite needs every framework: no silent skip)
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import fla_jax.interop as jax_interop  # noqa: E402
import fla_jax.models as jm  # noqa: E402
import fla_torch.interop as torch_interop  # noqa: E402
import fla_torch.models as tm  # noqa: E402
from fla_jax.models import train as jax_train  # noqa: E402
from fla_torch.models import train as torch_train  # noqa: E402

ATTNS = ("linear_attention", "retention", "gla", "delta_net", "gated_deltanet", "gsa",
         "attention", "hybrid", "kda", "rwkv7")
# 'hybrid': Gated DeltaNet block 0, softmax Attention block 1 (LMConfig.attn_layers)
HYBRID = {"attn": "gated_deltanet", "attn_layers": [1]}
VOCAB = 23
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, head_dim=16)
# THE tolerances of this file (rel RMS; cross-framework rows get twice the per-framework one).
TOL_FP32 = 1e-5
TOL_BF16 = 2e-2
TOL_DECODE = 1e-5
TOL_TRAIN_LOSS = 1e-5        # |loss_torch - loss_jax| per step, fp32
TOL_TRAIN_PARAMS = 1e-3      # rel RMS of the parameter difference after 3 steps / RMS(update)
T_FULL, N_PREFILL = 24, 20   # decode: prefill 20 tokens, then 4 one at a time


def rel_rms(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((a - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def make_pair(attn: str, policy=None, seed: int = 0, **overrides):
    """(torch model, jax model, numpy state) with the torch model's (seeded) weights in both."""
    kw = {**SMALL, "attn": attn, "policy": policy, **(HYBRID if attn == "hybrid" else {}),
          **overrides}
    torch.manual_seed(seed)
    t_model = tm.CausalLM(tm.LMConfig(**kw))
    with torch.no_grad():   # norm weights off 1.0 so they matter
        for name, p in t_model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            if attn == "rwkv7" and ".attn." in name:   # zero-initialised (o_proj, lora.0, ...)
                p.add_(0.1 * torch.randn_like(p))
    state = torch_interop.to_numpy(t_model)
    j_model = jm.CausalLM(jm.LMConfig(**kw), rngs=nnx.Rngs(seed))
    jax_interop.from_state_dict(j_model, state)
    return t_model, j_model, state


def ids(B=2, T=40, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, (B, T))


def torch_logits(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x)).float().numpy()


def jax_logits(model, x):
    return np.asarray(model(jnp.asarray(x)).astype(jnp.float32))


def _decode_torch(model, x, n_prefill):
    with torch.no_grad():
        logits, cache = model(torch.from_numpy(x[:, :n_prefill]), use_cache=True)
        outs = [logits]
        for t in range(n_prefill, x.shape[1]):
            logits, cache = model(torch.from_numpy(x[:, t:t + 1]), cache=cache, use_cache=True)
            outs.append(logits)
    assert len(cache) == len(model.layers) and cache[0]["offset"] == x.shape[1]
    return torch.cat(outs, 1).numpy()


def _decode_jax(model, x, n_prefill):
    step = nnx.jit(lambda m, tok, c: m(tok, cache=c, use_cache=True))
    logits, cache = model(jnp.asarray(x[:, :n_prefill]), use_cache=True)
    outs = [logits]
    for t in range(n_prefill, x.shape[1]):
        logits, cache = step(model, jnp.asarray(x[:, t:t + 1]), cache)
        outs.append(logits)
    assert len(cache) == len(model.layers)
    for c in cache:     # recurrent states fp32; an Attention block's KV cache in its dtype
        state = c.get("recurrent_state")   # GSA: the tuple (hk, hv)
        assert all(p.dtype == jnp.float32 for p in (state if isinstance(state, tuple)
                                                     else () if state is None else (state,)))
        assert c.get("attn_state") is None or c["attn_state"][0].dtype == jnp.float32
    return np.asarray(jnp.concatenate(outs, 1))


@pytest.mark.parametrize("attn", ATTNS)
def test_lm_forward_parity_fp32_and_decode(attn):
    """fp32 logits vs the float64 oracle in both frameworks; then prefill + token-by-token
    decoding with the cache equals the full forward, in both frameworks."""
    t_model, j_model, state = make_pair(attn)
    x = ids(T=T_FULL)
    ref = torch_logits(t_model.double(), x)             # float64 oracle, same weights
    t_model.float()
    lt, lj = torch_logits(t_model, x), jax_logits(j_model, x)
    assert lt.shape == lj.shape == (2, T_FULL, VOCAB)
    e_t, e_j, e_x = rel_rms(lt, ref), rel_rms(lj, ref), rel_rms(lj, lt)
    assert e_t < TOL_FP32, f"torch fp32 vs fp64: {e_t:.2e}"
    assert e_j < TOL_FP32, f"jax fp32 vs fp64: {e_j:.2e}"
    assert e_x < 2 * TOL_FP32, f"jax vs torch fp32: {e_x:.2e}"

    dec_t, dec_j = _decode_torch(t_model, x, N_PREFILL), _decode_jax(j_model, x, N_PREFILL)
    tail = slice(N_PREFILL, None)          # the one-token-at-a-time positions alone
    for name, dec, full in (("torch", dec_t, lt), ("jax", dec_j, lj)):
        assert rel_rms(dec, full) < TOL_DECODE, f"{name} prefill+decode vs forward"
        err = rel_rms(dec[:, tail], full[:, tail])
        assert err < TOL_DECODE, f"{name} decoded tokens vs forward: {err:.2e}"
    # and decoding is sensitive: without the cache the last token's logits differ
    with torch.no_grad():
        fresh = t_model(torch.from_numpy(x[:, -1:])).numpy()
    assert rel_rms(fresh[:, 0], lt[:, -1]) > 1e-2


@pytest.mark.parametrize("attn", ["gla", "gated_deltanet"])
def test_lm_forward_parity_bf16(attn):
    policy = "params=fp32,compute=bf16,output=fp32"
    t_model, j_model, state = make_pair(attn, policy=policy)
    x = ids()
    t_ref = tm.CausalLM(tm.LMConfig(**SMALL, attn=attn)).double()
    t_ref.load_state_dict(torch_interop.from_numpy(state), strict=True)
    ref = torch_logits(t_ref, x)
    with torch.no_grad():
        lt_raw = t_model(torch.from_numpy(x))
    lj_raw = j_model(jnp.asarray(x))
    assert lt_raw.dtype == torch.float32 and lj_raw.dtype == jnp.float32   # policy output
    assert t_model.compute_dtype() == torch.bfloat16 and j_model.compute_dtype() == jnp.bfloat16
    lt, lj = lt_raw.numpy(), np.asarray(lj_raw)
    e_t, e_j, e_x = rel_rms(lt, ref), rel_rms(lj, ref), rel_rms(lj, lt)
    assert 1e-4 < e_t < TOL_BF16, f"torch bf16 vs fp64: {e_t:.2e} (bf16 must round)"
    assert 1e-4 < e_j < TOL_BF16, f"jax bf16 vs fp64: {e_j:.2e} (bf16 must round)"
    assert e_x < 2 * TOL_BF16, f"jax vs torch bf16: {e_x:.2e}"


@pytest.mark.parametrize("tie,attn", [(True, "gated_deltanet"), (False, "gated_deltanet"),
                                      (True, "hybrid"), (True, "rwkv7")])
def test_lm_round_trip_lossless(tie, attn, tmp_path):
    t_model, j_model, state = make_pair(attn, tie_embeddings=tie, seed=5)
    keys = set(t_model.state_dict())
    assert ("lm_head.weight" in keys) == (not tie)
    back = jax_interop.to_state_dict(j_model)
    assert set(back) == keys
    for k, v in state.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k
    # in memory, back into a fresh torch model (strict), bit for bit
    fresh = tm.CausalLM(t_model.config)
    fresh.load_state_dict(torch_interop.from_numpy(back), strict=True)
    for k, v in t_model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # through files: torch -> safetensors -> JAX -> safetensors -> torch
    p1, p2 = tmp_path / "t.safetensors", tmp_path / "j.safetensors"
    torch_interop.save_safetensors(t_model, p1)
    j2 = jm.CausalLM(jm.LMConfig(**t_model.config.to_dict()), rngs=nnx.Rngs(9))
    jax_interop.load_safetensors(j2, p1, strict=True)
    jax_interop.save_safetensors(j2, p2)
    t2 = tm.CausalLM(t_model.config)
    torch_interop.load_safetensors(t2, p2, strict=True)
    for k, v in t_model.state_dict().items():
        assert torch.equal(t2.state_dict()[k], v), k
    if tie:   # the tied head is the embedding matrix itself in both frameworks
        assert t2.head_weight() is t2.embeddings.weight
        assert np.array_equal(np.asarray(j2.head_weight()), state["embeddings.weight"])


def _layers_for(attn) -> int:
    return 2 if attn == "hybrid" else 1


def _train_torch(attn, lrs, batches):
    t_model, _, state = make_pair(attn, seed=7, num_layers=_layers_for(attn))
    opt = torch_train.adamw(t_model, weight_decay=0.1)
    losses = [torch_train.train_step(t_model, opt, torch.from_numpy(x), torch.from_numpy(y),
                                     lrs[i], clip_norm=1.0) for i, (x, y) in enumerate(batches)]
    return losses, torch_interop.to_numpy(t_model), state


@pytest.mark.parametrize("attn", ["gated_deltanet", "hybrid"])
def test_train_three_steps_agree(attn):
    lrs = torch_train.lr_schedule(1e-2, 3, warmup=1)
    rng = np.random.default_rng(11)
    batches = []
    for _ in range(3):
        w = rng.integers(0, VOCAB, (4, 33))
        batches.append((w[:, :-1], w[:, 1:]))
    t_losses, t_after, before = _train_torch(attn, lrs, batches)

    _, j_model, _ = make_pair(attn, seed=7, num_layers=_layers_for(attn))
    opt = jax_train.make_optimizer(j_model, jax_train.adamw(lrs, weight_decay=0.1))
    j_losses = [float(jax_train.train_step(j_model, opt, jnp.asarray(x), jnp.asarray(y),
                                           clip_norm=1.0)) for x, y in batches]
    j_after = jax_interop.to_state_dict(j_model)

    diffs = np.abs(np.subtract(t_losses, j_losses))
    assert diffs.max() < TOL_TRAIN_LOSS, f"losses torch {t_losses} jax {j_losses}"
    upd = np.concatenate([(t_after[k] - before[k]).ravel() for k in before])
    gap = np.concatenate([(j_after[k] - t_after[k]).ravel() for k in before])
    ratio = float(np.sqrt(np.mean(gap.astype(np.float64) ** 2) /
                          np.mean(upd.astype(np.float64) ** 2)))
    assert ratio < TOL_TRAIN_PARAMS, f"parameter gap / update size after 3 steps: {ratio:.2e}"
    # The same tolerance catches a 3% learning-rate error (the test can fail).
    bad_losses, bad_after, _ = _train_torch(attn, [lr * 1.03 for lr in lrs], batches)
    assert abs(bad_losses[-1] - t_losses[-1]) > 10 * TOL_TRAIN_LOSS
    bad_gap = np.concatenate([(bad_after[k] - t_after[k]).ravel() for k in before])
    assert np.sqrt(np.mean(bad_gap.astype(np.float64) ** 2) /
                   np.mean(upd.astype(np.float64) ** 2)) > 10 * TOL_TRAIN_PARAMS


def test_config_contract():
    cfg = tm.LMConfig(**SMALL, attn="gla", attn_kwargs={"use_short_conv": True})
    assert jm.LMConfig.from_dict(cfg.to_json()) == jm.LMConfig(**cfg.to_dict())
    for mod in (tm, jm):
        with pytest.raises(ValueError, match="attn='softmax'"):
            mod.LMConfig(attn="softmax")
        with pytest.raises(ValueError, match="unknown keys"):
            mod.LMConfig.from_dict({"hiden_size": 3})
        with pytest.raises(ValueError, match=r"attn_layers=\[2\]"):
            mod.LMConfig(**SMALL, attn_layers=[2])
    hybrid = tm.LMConfig(**SMALL, **HYBRID)
    assert hybrid.layer_types == ["gated_deltanet", "attention"]
    assert [hybrid.layer_class(i) for i in range(2)] == ["GatedDeltaNet", "Attention"]
    assert jm.LMConfig.from_dict(hybrid.to_json()) == hybrid
    t_model, j_model, _ = make_pair("retention")
    with pytest.raises(TypeError, match="input_ids"):
        t_model(torch.zeros(1, 4))
    with pytest.raises(TypeError, match="input_ids"):
        j_model(jnp.zeros((1, 4)))
