"""RWKV7Attention / KimiDeltaAttention refuse bad arguments with named errors, the same words
in both frameworks: v_first missing, misshapen or in another dtype; a cache whose shift state
does not fit; KDA's safe_gate without a lower bound; LMConfig's RWKV-7 constraints."""
from __future__ import annotations

import numpy as np
import pytest

import torch  # noqa: E402  (the suite needs every framework: no silent skip)
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import fla_jax.layers as jlayers  # noqa: E402
import fla_torch.layers as tlayers  # noqa: E402
from fla_contract.lm_config import LMConfig  # noqa: E402

KW = dict(hidden_size=16, head_dim=8, decay_low_rank_dim=8, gate_low_rank_dim=8,
          a_low_rank_dim=8, v_low_rank_dim=8)
FRAMEWORKS = ("torch", "jax")


def _layer(fw, cls, **kw):
    if fw == "torch":
        return getattr(tlayers, cls)(**kw)
    return getattr(jlayers, cls)(**kw, rngs=nnx.Rngs(0))


def _arr(fw, a, dtype="float32"):
    if fw == "torch":
        return torch.tensor(np.asarray(a), dtype=getattr(torch, dtype))
    return jnp.asarray(a, getattr(jnp, dtype))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_rwkv7_v_first_errors(fw):
    layer = _layer(fw, "RWKV7Attention", layer_idx=1, **KW)
    x = _arr(fw, np.zeros((2, 3, 16)))
    with pytest.raises(ValueError, match=r"RWKV7Attention: v_first is None with layer_idx=1"):
        layer(x)
    with pytest.raises(ValueError, match=r"RWKV7Attention: v_first has shape \[2, 3, 8\]; "
                                         r"expected \[B, T, value_dim\] = \[2, 3, 16\]"):
        layer(x, v_first=_arr(fw, np.zeros((2, 3, 8))))
    with pytest.raises(TypeError, match=r"RWKV7Attention: v_first has dtype bfloat16; "
                                        r"expected the compute dtype float32"):
        layer(x, v_first=_arr(fw, np.zeros((2, 3, 16)), "bfloat16"))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_rwkv7_shift_state_error(fw):
    layer = _layer(fw, "RWKV7Attention", layer_idx=0, **KW)
    x = _arr(fw, np.ones((2, 3, 16)))
    _, _, cache, _ = layer(x, use_cache=True)
    assert tuple(cache["shift_state"].shape) == (2, 16)
    bad = dict(cache, shift_state=cache["shift_state"][:1])
    with pytest.raises(ValueError, match=r"RWKV7Attention: past_key_values\['shift_state'\] "
                                         r"has shape \[1, 16\]; expected \[N, hidden_size\]"):
        layer(x[:, :1], past_key_values=bad, use_cache=True)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_kda_safe_gate_needs_lower_bound(fw):
    with pytest.raises(ValueError, match=r"KimiDeltaAttention: safe_gate=True with "
                                         r"lower_bound=None"):
        _layer(fw, "KimiDeltaAttention", hidden_size=16, head_dim=8, num_heads=2,
               safe_gate=True)
    with pytest.raises(ValueError, match=r"num_v_heads=3; expected a multiple of num_heads=2"):
        _layer(fw, "KimiDeltaAttention", hidden_size=16, head_dim=8, num_heads=2, num_v_heads=3)


def test_lm_config_rwkv7_rules():
    with pytest.raises(ValueError, match=r"attn='rwkv7' with num_heads \* head_dim = 32; "
                                         r"expected hidden_size = 64"):
        LMConfig(attn="rwkv7", hidden_size=64, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"block 0 in attn_layers"):
        LMConfig(attn="rwkv7", hidden_size=32, num_heads=2, head_dim=16, attn_layers=[0])
    kw = LMConfig(attn="rwkv7", hidden_size=32, num_heads=2, head_dim=16, expand_v=2,
                  num_layers=3).attn_kwargs_for(1)
    assert kw["head_dim"] == 16 and kw["value_dim"] == 64 and kw["num_hidden_layers"] == 3
    assert "num_heads" not in kw and kw["layer_idx"] == 1
