"""LinearAttention for Flax NNX (FLA's class name, constructor arguments and parameter names;
the same parameters and arithmetic as fla_torch.layers.LinearAttention)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ..modules import Linear, RMSNorm
from ..modules.feature_map import HadamardFeatureMap
from ..modules.precision import canonical, compute_dtype
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import (activate, call_op, check_mode, effective_mode, flatten_heads,
                          repeat_heads, split_heads)

_FEATURE_MAPS = ("elementwise_product", "elu", "relu", "identity")
_ACT = {"elu": "elu_p1", "relu": "relu", "identity": None}


class LinearAttention(nnx.Module):
    """Linear attention layer.

    Args (FLA's): mode, hidden_size, expand_k, expand_v, num_heads, num_kv_heads, feature_map
        ('elementwise_product' | 'elu' | 'relu' | 'identity'), tie_feature_map_qk, output_norm
        ('rmsnorm' | 'identity'), norm_q, norm_k, do_feature_map_norm, elementwise_affine,
        norm_eps. Flax's: dtype, param_dtype, rngs.
    Parameters: q_proj, k_proj, v_proj, o_proj, feature_map_q.layer{1,2}, feature_map_k.*
        (with tie_feature_map_qk one module under both names, as in torch), norm.weight.
    __call__ -> (o [B, T, hidden], None, cache dict or None); see layers/cache.py.
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 1.0, num_heads: int = 8, num_kv_heads: int | None = None,
                 feature_map: str = "elementwise_product", tie_feature_map_qk: bool = False,
                 output_norm: str = "rmsnorm", norm_q: bool = False, norm_k: bool = False,
                 do_feature_map_norm: bool = False, elementwise_affine: bool = True,
                 norm_eps: float = 1e-5, layer_idx: int | None = None, *, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs, **kwargs):
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
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        f = {"dtype": self.dtype, "param_dtype": self.param_dtype, "rngs": rngs}
        if feature_map == "elementwise_product":
            self.feature_map_q = HadamardFeatureMap(self.head_k_dim,
                                                    param_dtype=self.param_dtype, rngs=rngs)
            self.feature_map_k = (self.feature_map_q if tie_feature_map_qk else
                                  HadamardFeatureMap(self.head_k_dim,
                                                     param_dtype=self.param_dtype, rngs=rngs))
        self.q_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = Linear(hidden_size, self.key_dim_per_group, bias=False, **f)
        self.v_proj = Linear(hidden_size, self.value_dim_per_group, bias=False, **f)
        if output_norm == "rmsnorm":
            self.norm = RMSNorm(self.head_v_dim, elementwise_affine=elementwise_affine,
                                eps=norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
        self.o_proj = Linear(self.value_dim, hidden_size, bias=False, **f)

    def _phi(self, x, which: str, cd):
        if self.feature_map == "elementwise_product":
            return getattr(self, f"feature_map_{which}")(x, cd)
        return activate(x, _ACT[self.feature_map])

    def __call__(self, hidden_states, attention_mask=None, past_key_values=None,
                 use_cache: bool = False, cu_seqlens=None, **kwargs):
        mask = check_layer_call(self, "LinearAttention", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.dtype)
        x = hidden_states.astype(cd)
        state, _, offset = read_cache("LinearAttention", past_key_values, False)
        mode = effective_mode(self.mode, past_key_values, T)
        q = split_heads(self.q_proj(x, cd), self.head_k_dim)
        k = repeat_heads(split_heads(self.k_proj(x, cd), self.head_k_dim), self.num_kv_groups)
        v = repeat_heads(split_heads(self.v_proj(x, cd), self.head_v_dim), self.num_kv_groups)
        q, k = self._phi(q, "q", cd), self._phi(k, "k", cd)
        if self.norm_q:
            qf = q.astype(jnp.float32)
            q = (qf / (jnp.sum(qf, axis=-1, keepdims=True) + 1e-4)).astype(cd)
        if self.norm_k:
            kf = k.astype(jnp.float32)
            k = (kf / (jnp.sum(kf, axis=-1, keepdims=True) + 1e-4)).astype(cd)
        if mask is not None:
            k, v = neutralise(mask, k), neutralise(mask, v)
        o, state = call_op("simple_gla", mode, q, k, v, initial_state=state,
                           output_final_state=use_cache, cu_seqlens=cu_seqlens)
        extra = {}
        if self.do_feature_map_norm:
            if cu_seqlens is not None:
                raise NotImplementedError("LinearAttention: do_feature_map_norm=True with "
                                          "cu_seqlens is not supported yet")
            o, extra["k_sum"] = self._normalize(q, k, o, past_key_values)
        if self.output_norm == "rmsnorm":
            o = self.norm(o)
        o = self.o_proj(flatten_heads(o).astype(cd), cd)
        if mask is not None:
            o = neutralise(mask, o)
        cache = make_cache(state, None, next_offset(offset, T, cu_seqlens, mask),
                           **extra) if use_cache else None
        return o, None, cache

    def _normalize(self, q, k, o, past_key_values):
        """o / (scale * q . cumsum_t(k) + 1e-10) in float32; returns (o in o's dtype, the
        running k sum [B, H, K] float32)."""
        kf = jnp.cumsum(k.astype(jnp.float32), axis=1)
        if past_key_values is not None:
            kf = kf + past_key_values["k_sum"][:, None]
        z = jnp.sum(q.astype(jnp.float32) * self.head_k_dim ** -0.5 * kf, axis=-1,
                    keepdims=True)
        return (o.astype(jnp.float32) / (z + 1e-10)).astype(o.dtype), kf[:, -1]
