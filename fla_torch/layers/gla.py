"""GatedLinearAttention (FLA's class name, constructor arguments and parameter names).

Per token: q, k, v = (conv(proj(x))) in H heads (k, v and the gate shared by groups of
num_heads // num_kv_heads heads), a per-channel log-decay
gk = logsigmoid(gk_proj(x)) / gate_logit_normalizer (float32, optionally clamped from below),
GLA, then the output gate (FusedRMSNormGated by default) and o_proj.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..modules import ShortConvolution
from ..modules.precision import (compute_dtype, linear, linear_fp32, no_autocast, output_dtype,
                                 resolve_policy, storage_dtype)
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import (activate, build_output_norm, call_op, check_activation, check_mode,
                          effective_mode, output_gate, project_qkv, repeat_heads, split_heads)


class GatedLinearAttention(nn.Module):
    """Gated Linear Attention layer.

    Args (FLA's): mode ('chunk' | 'fused_recurrent' | 'fused_chunk', the last runs the chunk
        op), hidden_size, expand_k, expand_v, num_heads, num_kv_heads, feature_map (None or an
        activation name), use_short_conv, conv_size, conv_bias, use_output_gate, gate_fn,
        elementwise_affine, norm_eps, gate_logit_normalizer, gate_low_rank_dim, clamp_min,
        fuse_norm, layer_idx. Ours: device, dtype (parameter storage), policy (compute).
    Parameters: q_proj [key_dim, hidden]; k_proj [key_dim / groups, hidden]; v_proj
        [value_dim / groups, hidden]; g_proj [value_dim, hidden] (use_output_gate);
        q/k/v_conv1d (use_short_conv); gk_proj.0 [low_rank, hidden], gk_proj.1 [key_dim / groups,
        low_rank] + bias; o_proj [hidden, value_dim]; g_norm_swish_gate.weight or g_norm.weight.
    forward -> (o [B, T, hidden], None, cache dict or None); see layers/cache.py.
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 0.5,
                 expand_v: float = 1.0, num_heads: int = 4, num_kv_heads: int | None = None,
                 feature_map: str | None = None, use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True,
                 gate_fn: str = "swish", elementwise_affine: bool | None = True,
                 norm_eps: float = 1e-5, gate_logit_normalizer: int = 16,
                 gate_low_rank_dim: int = 16, clamp_min: float | None = None,
                 fuse_norm: bool = True, layer_idx: int | None = None, device=None, dtype=None,
                 policy=None, **kwargs):
        super().__init__()
        name = "GatedLinearAttention"
        self.mode = check_mode(name, mode, ("chunk", "fused_recurrent", "fused_chunk"))
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
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        for dim_name, dim in (("key_dim", self.key_dim), ("value_dim", self.value_dim)):
            if dim % num_heads != 0:
                raise ValueError(f"{name}: {dim_name}={dim} is not divisible by "
                                 f"num_heads={num_heads}")
        self.key_dim_per_group = self.key_dim // self.num_kv_groups
        self.value_dim_per_group = self.value_dim // self.num_kv_groups
        self.clamp_min = clamp_min
        self.layer_idx = layer_idx
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.gate_logit_normalizer = gate_logit_normalizer
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
        self.gk_proj = nn.Sequential(
            nn.Linear(hidden_size, gate_low_rank_dim, bias=False, **f),
            nn.Linear(gate_low_rank_dim, self.key_dim_per_group, bias=True, **f))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **f)
        build_output_norm(self, gate_fn, fuse_norm, elementwise_affine, norm_eps, f)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """float32 gk [B, T, H, K] = logsigmoid(gk_proj(x)) / gate_logit_normalizer."""
        with no_autocast(x):
            gk = linear_fp32(linear_fp32(x, self.gk_proj[0]), self.gk_proj[1])
            gk = F.logsigmoid(gk) / self.gate_logit_normalizer
            if self.clamp_min is not None:
                gk = torch.clamp_min(gk, self.clamp_min)
        return repeat_heads(split_heads(gk, self.head_k_dim), self.num_kv_groups)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, cu_seqlens=None,
                **kwargs):
        mask = check_layer_call(self, "GatedLinearAttention", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.policy)
        x = hidden_states.to(cd)
        state, conv_cache, offset = read_cache("GatedLinearAttention", past_key_values,
                                               self.use_short_conv)
        mode = effective_mode(self.mode, past_key_values, T)
        q, k, v, conv_state = project_qkv(self, x, cd, conv_cache, use_cache,
                                          cu_seqlens=cu_seqlens, mask=mask)
        q = split_heads(q, self.head_k_dim)
        k = repeat_heads(split_heads(k, self.head_k_dim), self.num_kv_groups)
        v = repeat_heads(split_heads(v, self.head_v_dim), self.num_kv_groups)
        q, k = activate(q, self.feature_map), activate(k, self.feature_map)
        gk = self.log_decay(x)
        if mask is not None:
            k, v, gk = neutralise(mask, k), neutralise(mask, v), neutralise(mask, gk)
        o, state = call_op("gla", mode, q, k, v, g=gk, initial_state=state,
                           output_final_state=use_cache, cu_seqlens=cu_seqlens)
        o = linear(output_gate(self, o, x, cd), self.o_proj, cd).to(output_dtype(cd, self.policy))
        if mask is not None:
            o = neutralise(mask, o)
        cache = (make_cache(state, conv_state, next_offset(offset, T, cu_seqlens, mask))
                 if use_cache else None)
        return o, None, cache
