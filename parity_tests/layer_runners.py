"""Run one layer configuration in fla_torch and fla_jax on the same weights and inputs.

The weights come from the torch layer (seeded), go through fla_torch.interop.to_numpy and
fla_jax.interop.from_state_dict; inputs and output cotangents are drawn once in float64 numpy.
Each runner returns numpy float64 copies of: the output 'o', the input gradient 'dx' and one
'd:<param name>' per parameter gradient (torch names in both frameworks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

HIDDEN = 32


@dataclass(frozen=True)
class LayerCase:
    name: str
    cls: str
    kwargs: dict = field(default_factory=dict)
    B: int = 2
    T: int = 70          # crosses one 64-token chunk boundary, not a multiple of 64


LAYER_CASES = (
    LayerCase("gdn", "GatedDeltaNet",
              dict(hidden_size=HIDDEN, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1.5)),
    LayerCase("gdn_nogate", "GatedDeltaNet",
              dict(hidden_size=HIDDEN, head_dim=8, num_heads=2, use_gate=False, conv_bias=True,
                   allow_neg_eigval=True)),
    LayerCase("deltanet", "DeltaNet", dict(hidden_size=HIDDEN, num_heads=2, use_gate=True)),
    LayerCase("deltanet_elu_sum", "DeltaNet",
              dict(hidden_size=HIDDEN, num_heads=2, qk_activation="elu", qk_norm="sum",
                   use_beta=False, conv_bias=True)),
    LayerCase("gla", "GatedLinearAttention",
              dict(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, use_short_conv=True)),
    LayerCase("gla_unfused", "GatedLinearAttention",
              dict(hidden_size=HIDDEN, num_heads=2, fuse_norm=False, feature_map="relu",
                   clamp_min=-0.3)),
    LayerCase("gsa", "GatedSlotAttention",
              dict(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, num_slots=12,
                   use_short_conv=True)),
    LayerCase("retention", "MultiScaleRetention",
              dict(hidden_size=HIDDEN, num_heads=2, num_kv_heads=1)),
    LayerCase("linear_attn", "LinearAttention",
              dict(hidden_size=HIDDEN, num_heads=2, tie_feature_map_qk=True)),
    LayerCase("linear_attn_norm", "LinearAttention",
              dict(hidden_size=HIDDEN, num_heads=2, feature_map="elu", do_feature_map_norm=True,
                   num_kv_heads=1)),
    LayerCase("attn", "Attention",
              dict(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, qk_norm=True)),
    LayerCase("attn_window", "Attention",
              dict(hidden_size=HIDDEN, num_heads=2, qkv_bias=True, window_size=9,
                   rope_theta=500.0)),
)
CASES_BY_NAME = {c.name: c for c in LAYER_CASES}


def make_torch_layer(case: LayerCase, seed: int = 0):
    import torch

    import fla_torch.layers as layers
    torch.manual_seed(seed)
    layer = getattr(layers, case.cls)(**case.kwargs)
    with torch.no_grad():   # move norm weights off 1.0 so their gradients are exercised
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight") or name.endswith("swish_gate.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return layer


def make_jax_layer(case: LayerCase, state_dict: dict, **kw):
    from flax import nnx

    import fla_jax.layers as layers
    from fla_jax.interop import from_state_dict
    layer = getattr(layers, case.cls)(**case.kwargs, **kw, rngs=nnx.Rngs(0))
    from_state_dict(layer, state_dict)
    return layer


def draw(case: LayerCase, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((case.B, case.T, HIDDEN))
    dy = rng.standard_normal((case.B, case.T, HIDDEN))
    return x, dy


def run_torch(layer, x: np.ndarray, dy: np.ndarray, dtype: str) -> dict:
    """Layer (parameters as built, fp32 or fp64) on x cast to `dtype`; returns float64 numpy."""
    import torch

    from fla_torch.dtypes import to_dtype
    td = to_dtype(dtype)
    layer.zero_grad(set_to_none=True)
    xt = torch.tensor(x).to(td).requires_grad_(True)
    o, _, _ = layer(xt)
    o.backward(torch.tensor(dy).to(o.dtype))
    out = {"o": o.detach().double().numpy(), "dx": xt.grad.double().numpy(),
           "o_dtype": str(o.dtype), "dx_dtype": str(xt.grad.dtype)}
    for name, p in layer.named_parameters():
        out["d:" + name] = p.grad.double().numpy()
    return out


def run_jax(layer, x: np.ndarray, dy: np.ndarray, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fla_jax.dtypes import to_dtype
    from fla_jax.interop import to_state_dict
    jd = to_dtype(dtype)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    xj = jnp.asarray(x).astype(jd)

    def loss(params, xj):
        o, _, _ = nnx.merge(graphdef, params, rest)(xj)
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(dy, jnp.float32)), o

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, o), (dparams, dx) = grad_fn(params, xj)
    grads = to_state_dict(nnx.merge(graphdef, dparams, rest))
    out = {"o": np.asarray(o.astype(jnp.float32), np.float64),
           "dx": np.asarray(dx.astype(jnp.float32), np.float64),
           "o_dtype": str(o.dtype), "dx_dtype": str(dx.dtype)}
    for name, g in grads.items():
        out["d:" + name] = np.asarray(g.astype(np.float32), np.float64)
    return out
