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
    perturb: float = 0.0     # add perturb * N(0, 1) to every parameter (zero-initialised ones)
    v_first: bool = False    # RWKV7Attention with layer_idx != 0: takes a v_first input


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
    LayerCase("rwkv7", "RWKV7Attention",
              dict(hidden_size=HIDDEN, head_dim=8, layer_idx=0, value_dim=48,
                   decay_low_rank_dim=8, gate_low_rank_dim=16, a_low_rank_dim=8,
                   v_low_rank_dim=8), perturb=0.3, T=48),
    LayerCase("rwkv7_vfirst", "RWKV7Attention",
              dict(hidden_size=HIDDEN, head_dim=16, layer_idx=1, num_hidden_layers=3,
                   fuse_norm=True, decay_low_rank_dim=8, gate_low_rank_dim=8,
                   a_low_rank_dim=8, v_low_rank_dim=8), perturb=0.2, v_first=True, T=48),
    LayerCase("kda", "KimiDeltaAttention",
              dict(hidden_size=HIDDEN, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1.5),
              T=48),
    LayerCase("kda_bound", "KimiDeltaAttention",
              dict(hidden_size=HIDDEN, head_dim=8, num_heads=4, safe_gate=True,
                   lower_bound=-3.0, allow_neg_eigval=True, conv_bias=True), perturb=0.1,
              T=48),
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
            if case.perturb:
                p.add_(case.perturb * torch.randn_like(p))
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


def draw_v_first(case: LayerCase, value_dim: int, seed: int = 4):
    """RWKV-7's v_first input [B, T, value_dim] (None unless case.v_first)."""
    if not case.v_first:
        return None
    return np.random.default_rng(seed).standard_normal((case.B, case.T, value_dim))


def run_torch(layer, x: np.ndarray, dy: np.ndarray, dtype: str, v_first=None) -> dict:
    """Layer (parameters as built, fp32 or fp64) on x cast to `dtype`; returns float64 numpy.
    v_first (RWKV-7, layer_idx != 0): float64 numpy, cast to `dtype`; its gradient is
    'dv_first'. A layer returning v_first (layer_idx 0) adds it as 'v_first'."""
    import torch

    from fla_torch.dtypes import to_dtype
    td = to_dtype(dtype)
    layer.zero_grad(set_to_none=True)
    xt = torch.tensor(x).to(td).requires_grad_(True)
    kw = {}
    if v_first is not None:
        kw["v_first"] = vt = torch.tensor(v_first).to(td).requires_grad_(True)
    res = layer(xt, **kw)
    o = res[0]
    o.backward(torch.tensor(dy).to(o.dtype))
    out = {"o": o.detach().double().numpy(), "dx": xt.grad.double().numpy(),
           "o_dtype": str(o.dtype), "dx_dtype": str(xt.grad.dtype)}
    if v_first is not None:
        out["dv_first"] = vt.grad.double().numpy()
    elif len(res) == 4:
        out["v_first"] = res[3].detach().double().numpy()
    for name, p in layer.named_parameters():
        out["d:" + name] = p.grad.double().numpy()
    return out


def run_jax(layer, x: np.ndarray, dy: np.ndarray, dtype: str, v_first=None) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from fla_jax.dtypes import to_dtype
    from fla_jax.interop import to_state_dict
    jd = to_dtype(dtype)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    xj = jnp.asarray(x).astype(jd)
    vj = None if v_first is None else jnp.asarray(v_first).astype(jd)

    def loss(params, xj, vj):
        res = nnx.merge(graphdef, params, rest)(xj, **({} if vj is None else {"v_first": vj}))
        o = res[0]
        aux = (o, res[3] if len(res) == 4 else None)
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(dy, jnp.float32)), aux

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, (o, vf_out)), (dparams, dx, dv) = grad_fn(params, xj, vj)
    grads = to_state_dict(nnx.merge(graphdef, dparams, rest))
    out = {"o": np.asarray(o.astype(jnp.float32), np.float64),
           "dx": np.asarray(dx.astype(jnp.float32), np.float64),
           "o_dtype": str(o.dtype), "dx_dtype": str(dx.dtype)}
    if vj is not None:
        out["dv_first"] = np.asarray(dv.astype(jnp.float32), np.float64)
    elif vf_out is not None:
        out["v_first"] = np.asarray(vf_out.astype(jnp.float32), np.float64)
    for name, g in grads.items():
        out["d:" + name] = np.asarray(g.astype(np.float32), np.float64)
    return out
