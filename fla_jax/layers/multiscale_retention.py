"""MultiScaleRetention (RetNet) for Flax NNX (FLA's class name, constructor arguments and
parameter names; the same parameters and arithmetic as fla_torch.layers.MultiScaleRetention)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from . import context_parallel
from ..modules import Linear, ShortConvolution
from ..modules.precision import canonical, compute_dtype
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import masked_positions, neutralise, next_offset
from .projections import (activate, build_output_norm, call_op, check_activation, check_mode,
                          effective_mode, output_gate, project_qkv, repeat_heads, split_heads)
from .rotary import apply_rotary, retention_log_decay, rotary_positions


class MultiScaleRetention(nnx.Module):
    """Multi-scale retention layer.

    Args (FLA's): mode ('chunk' | 'fused_recurrent' | 'fused_chunk' | 'parallel'), hidden_size,
        expand_k, expand_v, num_heads, num_kv_heads, feature_map, use_short_conv, conv_size,
        conv_bias, use_output_gate, gate_fn, elementwise_affine, norm_eps, fuse_norm,
        layer_idx. Flax's: dtype, param_dtype, rngs.
    Parameters: q_proj, k_proj, v_proj, g_proj, q/k/v_conv1d, o_proj, g_norm_swish_gate.weight
        or g_norm.weight -- torch names and shapes. Rotary has no parameters.
    __call__ -> (o [B, T, hidden], None, cache dict or None); see layers/cache.py.
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 2.0, num_heads: int = 8, num_kv_heads: int | None = None,
                 feature_map: str | None = None, use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True,
                 gate_fn: str = "swish", elementwise_affine: bool | None = True,
                 norm_eps: float = 1e-5, fuse_norm: bool = True, layer_idx: int | None = None,
                 *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs, **kwargs):
        name = "MultiScaleRetention"
        self.mode = check_mode(name, mode, ("chunk", "fused_recurrent", "fused_chunk",
                                            "parallel"))
        self.hidden_size = hidden_size
        self.expand_k, self.expand_v = expand_k, expand_v
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if num_heads % self.num_kv_heads != 0:
            raise ValueError(f"{name}: num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.feature_map = check_activation(name, "feature_map", feature_map)
        self.use_short_conv = use_short_conv
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.use_output_gate = use_output_gate
        key_dim, value_dim = hidden_size * expand_k, hidden_size * expand_v
        self.key_dim, self.value_dim = round(key_dim), round(value_dim)
        if abs(key_dim - self.key_dim) > 1e-6 or abs(value_dim - self.value_dim) > 1e-6:
            raise ValueError(f"{name}: hidden_size * expand_k = {key_dim} and hidden_size * "
                             f"expand_v = {value_dim}; expected integers")
        for dim_name, dim in (("key_dim", self.key_dim), ("value_dim", self.value_dim)):
            if dim % num_heads != 0:
                raise ValueError(f"{name}: {dim_name}={dim} is not divisible by "
                                 f"num_heads={num_heads}")
        self.key_dim_per_group = self.key_dim // self.num_kv_groups
        self.value_dim_per_group = self.value_dim // self.num_kv_groups
        self.layer_idx = layer_idx
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        check_activation(name, "gate_fn", gate_fn, allow_none=False)
        f = {"dtype": self.dtype, "param_dtype": self.param_dtype, "rngs": rngs}
        self.q_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = Linear(hidden_size, self.key_dim_per_group, bias=False, **f)
        self.v_proj = Linear(hidden_size, self.value_dim_per_group, bias=False, **f)
        if use_output_gate:
            self.g_proj = Linear(hidden_size, self.value_dim, bias=False, **f)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **f)
            self.k_conv1d = ShortConvolution(self.key_dim_per_group, conv_size, bias=conv_bias,
                                             **f)
            self.v_conv1d = ShortConvolution(self.value_dim_per_group, conv_size,
                                             bias=conv_bias, **f)
        self.o_proj = Linear(self.value_dim, hidden_size, bias=False, **f)
        build_output_norm(self, gate_fn, fuse_norm, elementwise_affine, norm_eps,
                          {"dtype": self.dtype, "param_dtype": self.param_dtype})

    def __call__(self, hidden_states, attention_mask=None, past_key_values=None,
                 use_cache: bool = False, cu_seqlens=None, **kwargs):
        mask = check_layer_call(self, "MultiScaleRetention", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.dtype)
        x = hidden_states.astype(cd)
        state, conv_cache, offset = read_cache("MultiScaleRetention", past_key_values,
                                               self.use_short_conv)
        mode = effective_mode(self.mode, past_key_values, T)
        q, k, v, conv_state = project_qkv(self, x, cd, conv_cache, use_cache,
                                          cu_seqlens=cu_seqlens, mask=mask)
        q, k = split_heads(q, self.head_k_dim), split_heads(k, self.head_k_dim)
        q, k = activate(q, self.feature_map), activate(k, self.feature_map)
        if mask is not None:
            context_parallel.refuse("MultiScaleRetention", "attention_mask (padding)")
        pos = (rotary_positions(B, T, offset + context_parallel.slice_start(T), cu_seqlens)
               if mask is None
               else masked_positions(mask, offset))     # positions count real tokens only
        q, k = apply_rotary(q, pos), apply_rotary(k, pos)
        k = repeat_heads(k, self.num_kv_groups)
        v = repeat_heads(split_heads(v, self.head_v_dim), self.num_kv_groups)
        g_gamma, g = retention_log_decay(self.num_heads), None
        if mask is not None:    # padding: per-token g = g_gamma * mask instead of g_gamma
            k, v = neutralise(mask, k), neutralise(mask, v)
            g = neutralise(mask, jnp.broadcast_to(g_gamma, (B, T, self.num_heads)))
            g_gamma = None
        o, state = call_op("simple_gla", mode, q, k, v, g=g, g_gamma=g_gamma, initial_state=state,
                           output_final_state=use_cache, cu_seqlens=cu_seqlens)
        o = self.o_proj(output_gate(self, o, x, cd), cd)
        if mask is not None:
            o = neutralise(mask, o)
        cache = (make_cache(state, conv_state, next_offset(offset, T, cu_seqlens, mask))
                 if use_cache else None)
        return o, None, cache
