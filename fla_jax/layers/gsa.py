"""GatedSlotAttention for Flax NNX (FLA's class name, constructor arguments and parameter
names; the same parameters, shapes and arithmetic as fla_torch.layers.GatedSlotAttention)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..modules import Linear, RMSNorm, ShortConvolution
from ..modules.precision import canonical, compute_dtype
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import (activate, call_op, check_mode, effective_mode, project_qkv,
                          repeat_heads, split_heads)

FEATURE_MAPS = ("swish", "relu")


class GatedSlotAttention(nnx.Module):
    """Gated Slot Attention layer.

    Args (FLA's): mode ('chunk' | 'fused_recurrent'), hidden_size, expand_k, expand_v,
        num_heads, num_kv_heads, use_short_conv, conv_size, conv_bias, num_slots (default
        head_k_dim), elementwise_affine, norm_eps, gate_logit_normalizer, feature_map ('swish'
        | 'relu'; FLA's 't2r' is not supported), use_output_gate, use_norm (kept, unused as in
        FLA), layer_idx, scale (default 1.0). Flax's: dtype, param_dtype, rngs.
    Parameters: q_proj, k_proj, v_proj, f_proj, q/k/v_conv1d, g_norm.weight, o_proj -- torch
        names and shapes (all in param_dtype).
    __call__ -> (o [B, T, hidden], None, cache dict or None); the cache's recurrent_state is
        the tuple (hk [B, num_heads, K, M], hv [B, num_heads, M, V]) fp32 (layers/cache.py).
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0,
                 expand_v: float = 1.0, num_heads: int = 4, num_kv_heads: int | None = None,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 num_slots: int | None = None, elementwise_affine: bool | None = True,
                 norm_eps: float = 1e-5, gate_logit_normalizer: int = 8,
                 feature_map: str = "swish", use_output_gate: bool = False,
                 use_norm: bool = True, layer_idx: int | None = None, scale: float | None = 1.0,
                 *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs, **kwargs):
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
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        f = {"dtype": self.dtype, "param_dtype": self.param_dtype, "rngs": rngs}
        self.q_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = Linear(hidden_size, self.key_dim_per_group, bias=False, **f)
        self.v_proj = Linear(hidden_size, self.value_dim_per_group, bias=False, **f)
        self.f_proj = Linear(hidden_size, self.num_kv_heads * self.num_slots, bias=False, **f)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **f)
            self.k_conv1d = ShortConvolution(self.key_dim_per_group, conv_size, bias=conv_bias,
                                             **f)
            self.v_conv1d = ShortConvolution(self.value_dim_per_group, conv_size,
                                             bias=conv_bias, **f)
        self.g_norm = RMSNorm(hidden_size, elementwise_affine=elementwise_affine, eps=norm_eps,
                              dtype=self.dtype, param_dtype=self.param_dtype)
        self.o_proj = Linear(self.value_dim, hidden_size, bias=False, **f)

    def state_layouts(self, N: int):
        """The cache's recurrent_state parts: ((shape, layout) of hk, of hv)."""
        H, K, V, M = self.num_heads, self.head_k_dim, self.head_v_dim, self.num_slots
        return (((N, H, K, M), "hk [N, H, K, M]"), ((N, H, M, V), "hv [N, H, M, V]"))

    def slot_gate(self, x):
        """(f float32 [B, T, H, M] = logsigmoid(f_proj(x)) / gate_logit_normalizer,
        s = 1 - exp(f) in x's dtype), repeated to num_heads."""
        f = jax.nn.log_sigmoid(self.f_proj(x, jnp.float32)) / self.gate_logit_normalizer
        s = (1 - jnp.exp(f)).astype(x.dtype)
        f, s = split_heads(f, self.num_slots), split_heads(s, self.num_slots)
        return repeat_heads(f, self.num_kv_groups), repeat_heads(s, self.num_kv_groups)

    def __call__(self, hidden_states, attention_mask=None, past_key_values=None,
                 use_cache: bool = False, cu_seqlens=None, **kwargs):
        mask = check_layer_call(self, "GatedSlotAttention", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.dtype)
        x = hidden_states.astype(cd)
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
        o = self.o_proj(self.g_norm(o).astype(cd), cd)
        if mask is not None:
            o = neutralise(mask, o)
        cache = (make_cache(state, conv_state, next_offset(offset, T, cu_seqlens, mask))
                 if use_cache else None)
        return o, None, cache
