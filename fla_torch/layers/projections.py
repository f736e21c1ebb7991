"""Pieces every layer shares: q/k/v projections with optional short convolutions, head
reshapes, elementwise activations by name, the op call for a mode, and the mode rule."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from . import context_parallel
from ..modules.precision import linear, no_autocast

MODES = ("chunk", "fused_recurrent")
# FLA mode names without a separate op here: they run the chunk ops.
MODE_ALIASES = {"fused_chunk": "chunk", "parallel": "chunk"}


def check_mode(layer_name: str, mode: str, allowed: tuple) -> str:
    if mode not in allowed:
        raise ValueError(f"{layer_name}: mode={mode!r}; expected one of "
                         f"{', '.join(repr(m) for m in allowed)}")
    return MODE_ALIASES.get(mode, mode)


def effective_mode(mode: str, past_key_values, T: int) -> str:
    """The rule (same in fla_jax): a call continuing from a cache with T <= 64 new tokens runs
    the fused_recurrent op (decoding); every other call runs the layer's mode."""
    return "fused_recurrent" if (past_key_values is not None and T <= 64) else mode


def call_op(family: str, mode: str, q, k, v, **kwargs):
    """ops.chunk_<family> or ops.fused_recurrent_<family> with impl='auto' (inside
    layers.context_parallel: with the context's cp argument)."""
    fn = getattr(ops, f"{mode}_{family}")
    return fn(q, k, v, impl="auto", **kwargs, **context_parallel.op_kwargs(family, mode))


def project_qkv(layer, x: torch.Tensor, cd: torch.dtype, conv_cache, use_cache: bool,
                qk_silu_without_conv: bool = False, cu_seqlens=None, mask=None):
    """q, k, v = (conv(proj(x))) in dtype cd. Returns (q, k, v, conv_state or None).

    layer has q_proj/k_proj/v_proj and, when layer.use_short_conv, q_conv1d/k_conv1d/v_conv1d.
    Without short convs, q and k get silu when qk_silu_without_conv and v always gets silu
    only for the delta-rule layers (they pass qk_silu_without_conv / layer.v_silu).
    mask: None or bool [B, T] (padding): the short convs see real tokens only (padding.py)."""
    q = linear(x, layer.q_proj, cd)
    k = linear(x, layer.k_proj, cd)
    v = linear(x, layer.v_proj, cd)
    if layer.use_short_conv:
        context_parallel.refuse(type(layer).__name__, "use_short_conv=True")
        cq, ck, cv = conv_cache
        if mask is not None:    # padding: each row's real tokens only (layers/padding.py)
            from .padding import masked_short_conv
            q, cq = masked_short_conv(layer.q_conv1d, q, mask, cq, use_cache)
            k, ck = masked_short_conv(layer.k_conv1d, k, mask, ck, use_cache)
            v, cv = masked_short_conv(layer.v_conv1d, v, mask, cv, use_cache)
            return q, k, v, ((cq, ck, cv) if use_cache else None)
        q, cq = layer.q_conv1d(q, cache=cq, output_final_state=use_cache,
                                   cu_seqlens=cu_seqlens)
        k, ck = layer.k_conv1d(k, cache=ck, output_final_state=use_cache,
                                   cu_seqlens=cu_seqlens)
        v, cv = layer.v_conv1d(v, cache=cv, output_final_state=use_cache,
                                   cu_seqlens=cu_seqlens)
        return q, k, v, ((cq, ck, cv) if use_cache else None)
    if qk_silu_without_conv:
        q, k = activate(q, "silu"), activate(k, "silu")
    if getattr(layer, "v_silu_without_conv", False):
        v = activate(v, "silu")
    return q, k, v, None


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, T, H * D] -> [B, T, H, D]."""
    return x.unflatten(-1, (x.shape[-1] // head_dim, head_dim))


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, T, H * groups, D], each head repeated `groups` times in a row
    (FLA's '... (h d) -> ... (h g) d')."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


_ACTS = {
    "swish": F.silu, "silu": F.silu, "relu": F.relu, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "elu": F.elu, "identity": lambda x: x,
    "elu_p1": lambda x: F.elu(x) + 1.0, "logsigmoid": F.logsigmoid,
}
ACTIVATIONS = tuple(_ACTS)


def check_activation(layer_name: str, arg: str, name, allow_none: bool = True):
    if name is None and allow_none:
        return None
    if name not in _ACTS:
        raise ValueError(f"{layer_name}: {arg}={name!r}; expected "
                         f"{'None or ' if allow_none else ''}one of {', '.join(ACTIVATIONS)}")
    return name


def activate(x: torch.Tensor, name: str | None) -> torch.Tensor:
    """Elementwise activation computed in float32, returned in x's dtype."""
    if name is None:
        return x
    with no_autocast(x):
        return _ACTS[name](x.float()).to(x.dtype)


def output_gate(layer, o: torch.Tensor, x: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """GLA / MultiScaleRetention output stage: o [B, T, H, V] -> [B, T, H * V] in cd.

    use_output_gate and fuse_norm_and_gate: g_norm_swish_gate(o, g_proj(x)); use_output_gate
    only: g_norm(o) * gate_fn(g_proj(x)); otherwise g_norm(o)."""
    if layer.use_output_gate:
        g = linear(x, layer.g_proj, cd)
        if layer.fuse_norm_and_gate:
            return layer.g_norm_swish_gate(o, split_heads(g, layer.head_v_dim)).flatten(-2)
        normed = layer.g_norm(o).flatten(-2).to(cd)
        return normed * activate(g, layer.gate_fn)
    return layer.g_norm(o).flatten(-2).to(cd)


def build_output_norm(layer, gate_fn: str, fuse_norm: bool, elementwise_affine, norm_eps: float,
                      factory: dict) -> None:
    """Create FLA's g_norm_swish_gate (FusedRMSNormGated) or g_norm (RMSNorm) on `layer`."""
    from ..modules import FusedRMSNormGated, RMSNorm
    layer.gate_fn = gate_fn
    if gate_fn == "swish" and fuse_norm and layer.use_output_gate:
        layer.g_norm_swish_gate = FusedRMSNormGated(
            layer.head_v_dim, elementwise_affine=elementwise_affine, eps=norm_eps,
            policy=layer.policy, **factory)
        layer.fuse_norm_and_gate = True
    else:
        layer.fuse_norm_and_gate = False
        layer.g_norm = RMSNorm(layer.head_v_dim, elementwise_affine=elementwise_affine,
                               eps=norm_eps, policy=layer.policy, **factory)
