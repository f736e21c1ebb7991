"""GatedSlotAttention (FLA's class name, constructor arguments and parameter names).

Per token: q, k, v = (conv(proj(x))) (k, v and the slot gate shared by groups of
num_heads // num_kv_heads heads), q, k through the feature map, v through silu, the slot
log-decay f = logsigmoid(f_proj(x)) / gate_logit_normalizer (float32) with write weights
s = 1 - exp(f) (in the compute dtype), GSA over num_slots slots, then
o_proj(RMSNorm(silu(o))) with the norm over the whole value_dim (FLA's g_norm).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..modules import RMSNorm, ShortConvolution
from ..modules.precision import (compute_dtype, linear, linear_fp32, no_autocast, output_dtype,
                                 resolve_policy, storage_dtype)
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import (activate, call_op, check_mode, effective_mode, project_qkv,
                          repeat_heads, split_heads)

FEATURE_MAPS = ("swish", "relu")


class GatedSlotAttention(nn.Module):
    """Gated Slot Attention layer.

    Args (FLA's): mode ('chunk' | 'fused_recurrent'), hidden_size, expand_k, expand_v,
        num_heads, num_kv_heads, use_short_conv, conv_size, conv_bias, num_slots (default
        head_k_dim), elementwise_affine, norm_eps, gate_logit_normalizer, feature_map ('swish'
        | 'relu'; FLA's 't2r' is not supported), use_output_gate, use_norm (kept, unused as in
        FLA), layer_idx, scale (default 1.0, as FLA's layer). Ours: device, dtype (parameter
        storage), policy (compute).
    Parameters: q_proj [key_dim, hidden]; k_proj [key_dim / groups, hidden]; v_proj
        [value_dim / groups, hidden]; f_proj [num_kv_heads * num_slots, hidden];
        q/k/v_conv1d (use_short_conv); g_norm.weight [hidden_size] (stored like the others:
        FLA keeps it float32; the norm computes in float32 either way; hidden_size must equal
        value_dim); o_proj [hidden, value_dim].
    forward -> (o [B, T, hidden], None, cache dict or None); the cache's recurrent_state is
        the tuple (hk [B, num_heads, K, M], hv [B, num_heads, M, V]) fp32 (layers/cache.py).
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 1.0, num_heads: int = 4, num_kv_heads: int | None = None,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 num_slots: int | None = None, elementwise_affine: bool | None = True,
                 norm_eps: float = 1e-5, gate_logit_normalizer: int = 8,
                 feature_map: str = "swish", use_output_gate: bool = False,
                 use_norm: bool = True, layer_idx: int | None = None, scale: float | None = 1.0,
                 device=None, dtype=None, policy=None, **kwargs):
        super().__init__()
        name = "GatedSlotAttention"
        self.mode = check_mode(name, mode, ("chunk", "fused_recurrent"))
        self.hidden_size = hidden_size
        self.expand_k, self.expand_v = expand_k, expand_v
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if num_heads % self.num_kv_heads != 0:
            raise ValueError(f"{name}: num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        for dim_name, dim in (("key_dim", self.key_dim), ("value_dim", self.value_dim)):
            if dim % num_heads != 0:
                raise ValueError(f"{name}: {dim_name}={dim} is not divisible by "
                                 f"num_heads={num_heads}")
        if self.value_dim != hidden_size:
            raise ValueError(f"{name}: value_dim={self.value_dim} (hidden_size * expand_v); "
                             f"expected hidden_size={hidden_size} (g_norm is over hidden_size)")
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"{name}: feature_map={feature_map!r}; expected one of "
                             f"{', '.join(FEATURE_MAPS)}")
        self.feature_map = feature_map
        self.key_dim_per_group = self.key_dim // self.num_kv_groups
        self.value_dim_per_group = self.value_dim // self.num_kv_groups
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.use_short_conv = use_short_conv
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.gate_logit_normalizer = gate_logit_normalizer
        self.use_output_gate, self.use_norm = use_output_gate, use_norm
        self.scale = scale
        self.num_slots = num_slots if num_slots is not None else self.head_k_dim
        self.layer_idx = layer_idx
        self.policy = resolve_policy(policy)
        f = {"device": device, "dtype": storage_dtype(dtype, self.policy)}
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False, **f)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False, **f)
        self.f_proj = nn.Linear(hidden_size, self.num_kv_heads * self.num_slots, bias=False, **f)
        if use_short_conv:
            for proj, size in (("q", self.key_dim), ("k", self.key_dim_per_group),
                               ("v", self.value_dim_per_group)):
                setattr(self, f"{proj}_conv1d", ShortConvolution(
                    size, conv_size, bias=conv_bias, activation="silu", policy=self.policy, **f))
        self.g_norm = RMSNorm(hidden_size, elementwise_affine=elementwise_affine, eps=norm_eps,
                              policy=self.policy, **f)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **f)

    def state_layouts(self, N: int):
        """The cache's recurrent_state parts: ((shape, layout) of hk, of hv)."""
        H, K, V, M = self.num_heads, self.head_k_dim, self.head_v_dim, self.num_slots
        return (((N, H, K, M), "hk [N, H, K, M]"), ((N, H, M, V), "hv [N, H, M, V]"))

    def slot_gate(self, x: torch.Tensor):
        """(f float32 [B, T, H, M] = logsigmoid(f_proj(x)) / gate_logit_normalizer,
        s = 1 - exp(f) in x's dtype), repeated to num_heads."""
        with no_autocast(x):
            f = F.logsigmoid(linear_fp32(x, self.f_proj)) / self.gate_logit_normalizer
            s = (1 - f.exp()).to(x.dtype)
        f, s = split_heads(f, self.num_slots), split_heads(s, self.num_slots)
        return repeat_heads(f, self.num_kv_groups), repeat_heads(s, self.num_kv_groups)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, cu_seqlens=None,
                **kwargs):
        mask = check_layer_call(self, "GatedSlotAttention", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.policy)
        x = hidden_states.to(cd)
        state, conv_cache, offset = read_cache("GatedSlotAttention", past_key_values,
                                               self.use_short_conv)
        mode = effective_mode(self.mode, past_key_values, T)
        q, k, v, conv_state = project_qkv(self, x, cd, conv_cache, use_cache,
                                          cu_seqlens=cu_seqlens, mask=mask)
        q = activate(split_heads(q, self.head_k_dim), self.feature_map)
        k = activate(repeat_heads(split_heads(k, self.head_k_dim), self.num_kv_groups),
                     self.feature_map)
        v = activate(repeat_heads(split_heads(v, self.head_v_dim), self.num_kv_groups), "silu")
        g, s = self.slot_gate(x)
        if mask is not None:
            k, v, s, g = (neutralise(mask, t) for t in (k, v, s, g))
        o, state = call_op("gsa", mode, q, k, v, s=s, g=g, scale=self.scale,
                           initial_state=state, output_final_state=use_cache,
                           cu_seqlens=cu_seqlens)
        o = activate(o.reshape(B, T, self.value_dim), "silu")
        o = linear(self.g_norm(o), self.o_proj, cd).to(output_dtype(cd, self.policy))
        if mask is not None:
            o = neutralise(mask, o)
        cache = (make_cache(state, conv_state, next_offset(offset, T, cu_seqlens, mask))
                 if use_cache else None)
        return o, None, cache
