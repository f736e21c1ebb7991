"""MultiScaleRetention (RetNet; FLA's class name, constructor arguments and parameter names).

Per token: q, k, v = (conv(proj(x))) in H heads (k, v shared by groups of heads), optional
feature map, rotary positions on q and k, simple GLA with a fixed per-head decay
g_gamma[h] = log(1 - 2 ** (-5 - h)), then the output gate and o_proj.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import context_parallel
from ..modules import ShortConvolution
from ..modules.precision import (compute_dtype, linear, output_dtype, resolve_policy,
                                 storage_dtype)
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import masked_positions, neutralise, next_offset
from .projections import (activate, build_output_norm, call_op, check_activation, check_mode,
                          effective_mode, output_gate, project_qkv, repeat_heads, split_heads)
from .rotary import apply_rotary, retention_log_decay, rotary_positions


class MultiScaleRetention(nn.Module):
    """Multi-scale retention layer.

    Args (FLA's): mode ('chunk' | 'fused_recurrent' | 'fused_chunk' | 'parallel'; the last two
        run the chunk op), hidden_size, expand_k, expand_v, num_heads, num_kv_heads,
        feature_map, use_short_conv, conv_size, conv_bias, use_output_gate, gate_fn,
        elementwise_affine, norm_eps, fuse_norm, layer_idx.
        Ours: device, dtype (parameter storage), policy (compute DtypePolicy or string).
    Parameters: q_proj, k_proj, v_proj, g_proj (use_output_gate), q/k/v_conv1d
        (use_short_conv), o_proj, g_norm_swish_gate.weight or g_norm.weight. The rotary
        embedding has no parameters (FLA's inv_freq buffer is not persistent).
    forward -> (o [B, T, hidden], None, cache dict or None); the cache's 'offset' gives the
        rotary positions of the next tokens.
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 2.0, num_heads: int = 8, num_kv_heads: int | None = None,
                 feature_map: str | None = None, use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True,
                 gate_fn: str = "swish", elementwise_affine: bool | None = True,
                 norm_eps: float = 1e-5, fuse_norm: bool = True, layer_idx: int | None = None,
                 device=None, dtype=None, policy=None, **kwargs):
        super().__init__()
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
        self.policy = resolve_policy(policy)
        check_activation(name, "gate_fn", gate_fn, allow_none=False)
        dtype = storage_dtype(dtype, self.policy)
        f = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False, **f)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False, **f)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **f)
        if use_short_conv:
            for proj, size in (("q", self.key_dim), ("k", self.key_dim_per_group),
                               ("v", self.value_dim_per_group)):
                setattr(self, f"{proj}_conv1d", ShortConvolution(
                    size, conv_size, bias=conv_bias, activation="silu", policy=self.policy, **f))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **f)
        build_output_norm(self, gate_fn, fuse_norm, elementwise_affine, norm_eps, f)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, cu_seqlens=None,
                **kwargs):
        mask = check_layer_call(self, "MultiScaleRetention", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.policy)
        x = hidden_states.to(cd)
        state, conv_cache, offset = read_cache("MultiScaleRetention", past_key_values,
                                               self.use_short_conv)
        mode = effective_mode(self.mode, past_key_values, T)
        q, k, v, conv_state = project_qkv(self, x, cd, conv_cache, use_cache,
                                          cu_seqlens=cu_seqlens, mask=mask)
        q, k = split_heads(q, self.head_k_dim), split_heads(k, self.head_k_dim)
        q, k = activate(q, self.feature_map), activate(k, self.feature_map)
        if mask is not None:
            context_parallel.refuse("MultiScaleRetention", "attention_mask (padding)")
        pos = (rotary_positions(B, T, offset + context_parallel.slice_start(T), cu_seqlens, device=x.device)
               if mask is None
               else masked_positions(mask, offset))     # positions count real tokens only
        q, k = apply_rotary(q, pos), apply_rotary(k, pos)
        k = repeat_heads(k, self.num_kv_groups)
        v = repeat_heads(split_heads(v, self.head_v_dim), self.num_kv_groups)
        g_gamma, g = retention_log_decay(self.num_heads, device=x.device), None
        if mask is not None:    # padding: per-token g = g_gamma * mask instead of g_gamma
            k, v = neutralise(mask, k), neutralise(mask, v)
            g, g_gamma = neutralise(mask, g_gamma.expand(B, T, -1)), None
        o, state = call_op("simple_gla", mode, q, k, v, g=g, g_gamma=g_gamma, initial_state=state,
                           output_final_state=use_cache, cu_seqlens=cu_seqlens)
        o = linear(output_gate(self, o, x, cd), self.o_proj, cd).to(output_dtype(cd, self.policy))
        if mask is not None:
            o = neutralise(mask, o)
        cache = (make_cache(state, conv_state, next_offset(offset, T, cu_seqlens, mask))
                 if use_cache else None)
        return o, None, cache
