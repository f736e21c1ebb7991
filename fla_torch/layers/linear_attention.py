"""LinearAttention (FLA's class name `LinearAttention`, file linear_attn.py there; constructor
arguments and parameter names as FLA's).

Per token: q, k, v = proj(x) in H heads (k, v shared by groups of heads), feature maps phi_q,
phi_k, optional sum-normalisation of q / k, ungated linear attention
o_t = scale * phi(q_t) sum_{s<=t} phi(k_s)^T v_s (optionally divided by
scale * phi(q_t) . sum_{s<=t} phi(k_s) with do_feature_map_norm), an output RMSNorm and o_proj.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..modules import RMSNorm
from ..modules.feature_map import HadamardFeatureMap
from ..modules.precision import (compute_dtype, linear, no_autocast, output_dtype, resolve_policy,
                                 storage_dtype)
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import activate, call_op, check_mode, effective_mode, repeat_heads, split_heads

_FEATURE_MAPS = ("elementwise_product", "elu", "relu", "identity")
_ACT = {"elu": "elu_p1", "relu": "relu", "identity": None}


class LinearAttention(nn.Module):
    """Linear attention layer.

    Args (FLA's): mode ('chunk' | 'fused_recurrent' | 'fused_chunk', the last runs the chunk
        op), hidden_size, expand_k, expand_v, num_heads, num_kv_heads, feature_map
        ('elementwise_product' | 'elu' | 'relu' | 'identity'), tie_feature_map_qk,
        output_norm ('rmsnorm' | 'identity'), norm_q, norm_k, do_feature_map_norm,
        elementwise_affine, norm_eps. Ours: device, dtype, policy.
    Parameters: q_proj, k_proj, v_proj, o_proj; feature_map_q.layer{1,2}.{weight,bias} and
        feature_map_k.* ('elementwise_product'; with tie_feature_map_qk both names hold the
        same tensors, as in FLA); norm.weight ('rmsnorm').
    forward -> (o [B, T, hidden], None, cache dict or None). (FLA's LinearAttention returns o
        alone and has no cache; ours returns the same triple as the other layers.)
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 1.0, num_heads: int = 8, num_kv_heads: int | None = None,
                 feature_map: str = "elementwise_product", tie_feature_map_qk: bool = False,
                 output_norm: str = "rmsnorm", norm_q: bool = False, norm_k: bool = False,
                 do_feature_map_norm: bool = False, elementwise_affine: bool = True,
                 norm_eps: float = 1e-5, layer_idx: int | None = None, device=None, dtype=None,
                 policy=None, **kwargs):
        super().__init__()
        name = "LinearAttention"
        self.mode = check_mode(name, mode, ("chunk", "fused_recurrent", "fused_chunk"))
        if feature_map not in _FEATURE_MAPS:
            raise NotImplementedError(f"{name}: feature_map={feature_map!r}; supported: "
                                      f"{', '.join(_FEATURE_MAPS)}")
        if output_norm not in ("rmsnorm", "identity"):
            raise ValueError(f"{name}: output_norm={output_norm!r}; expected 'rmsnorm' or "
                             f"'identity'")
        self.hidden_size = hidden_size
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
        self.key_dim_per_group = self.key_dim // self.num_kv_groups
        self.value_dim_per_group = self.value_dim // self.num_kv_groups
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.feature_map = feature_map
        self.tie_feature_map_qk = tie_feature_map_qk
        self.output_norm = output_norm
        self.norm_q, self.norm_k = norm_q, norm_k
        self.do_feature_map_norm = do_feature_map_norm
        self.layer_idx = layer_idx
        self.policy = resolve_policy(policy)
        dtype = storage_dtype(dtype, self.policy)
        f = {"device": device, "dtype": dtype}
        if feature_map == "elementwise_product":
            self.feature_map_q = HadamardFeatureMap(self.head_k_dim, **f)
            self.feature_map_k = (self.feature_map_q if tie_feature_map_qk
                                  else HadamardFeatureMap(self.head_k_dim, **f))
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False, **f)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False, **f)
        if output_norm == "rmsnorm":
            self.norm = RMSNorm(self.head_v_dim, elementwise_affine=elementwise_affine,
                                eps=norm_eps, policy=self.policy, **f)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **f)

    def _phi(self, x: torch.Tensor, which: str, cd: torch.dtype) -> torch.Tensor:
        if self.feature_map == "elementwise_product":
            return getattr(self, f"feature_map_{which}")(x, cd)
        return activate(x, _ACT[self.feature_map])

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, cu_seqlens=None,
                **kwargs):
        mask = check_layer_call(self, "LinearAttention", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.policy)
        x = hidden_states.to(cd)
        state, _, offset = read_cache("LinearAttention", past_key_values, False)
        mode = effective_mode(self.mode, past_key_values, T)
        q = split_heads(linear(x, self.q_proj, cd), self.head_k_dim)
        k = repeat_heads(split_heads(linear(x, self.k_proj, cd), self.head_k_dim),
                         self.num_kv_groups)
        v = repeat_heads(split_heads(linear(x, self.v_proj, cd), self.head_v_dim),
                         self.num_kv_groups)
        q, k = self._phi(q, "q", cd), self._phi(k, "k", cd)
        with no_autocast(x):
            if self.norm_q:
                q = (q.float() / (q.float().sum(-1, keepdim=True) + 1e-4)).to(cd)
            if self.norm_k:
                k = (k.float() / (k.float().sum(-1, keepdim=True) + 1e-4)).to(cd)
        if mask is not None:
            k, v = neutralise(mask, k), neutralise(mask, v)
        o, state = call_op("simple_gla", mode, q, k, v, initial_state=state,
                           output_final_state=use_cache, cu_seqlens=cu_seqlens)
        extra = {}
        if self.do_feature_map_norm:
            if cu_seqlens is not None:
                raise NotImplementedError("LinearAttention: do_feature_map_norm=True with "
                                          "cu_seqlens is not supported yet")
            o, k_sum = self._normalize(q, k, o, past_key_values)
            extra["k_sum"] = k_sum
        if self.output_norm == "rmsnorm":
            o = self.norm(o)
        o = linear(o.flatten(-2).to(cd), self.o_proj, cd).to(output_dtype(cd, self.policy))
        if mask is not None:
            o = neutralise(mask, o)
        cache = make_cache(state, None, next_offset(offset, T, cu_seqlens, mask),
                           **extra) if use_cache else None
        return o, None, cache

    def _normalize(self, q, k, o, past_key_values):
        """o / (scale * q . cumsum_t(k) + 1e-10) in float32; returns (o in o's dtype, the
        running k sum [B, H, K] float32)."""
        with no_autocast(q):
            kf = k.float().cumsum(1)
            if past_key_values is not None:
                kf = kf + past_key_values["k_sum"][:, None]
            z = (q.float() * self.head_k_dim ** -0.5 * kf).sum(-1, keepdim=True)
            out = (o.float() / (z + 1e-10)).to(o.dtype)
        return out, kf[:, -1]
