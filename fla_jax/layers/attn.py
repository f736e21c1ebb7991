"""Attention for Flax NNX: softmax attention with FLA's class name, constructor arguments and
parameter names (the same parameters, shapes and arithmetic as fla_torch.layers.Attention)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from fla_contract.kv_cache import check_max_cache_len_use

from . import context_parallel
from ..modules import Linear, RMSNorm
from ..modules.precision import canonical, compute_dtype
from ..ops.attention import attention
from ..ops.attention.interface import attention_with_key_mask
from .inputs import check_layer_call
from .kv_cache import check_kv_cache, new_kv_cache, overflowed, write_kv
from .padding import masked_positions, neutralise, next_offset
from .projections import split_heads
from .rotary import apply_rotary, rotary_positions


class Attention(nnx.Module):
    """Multi-head (grouped-query) softmax attention layer.

    Args (FLA's): hidden_size, num_heads, num_kv_heads, qkv_bias, qk_norm, window_size (None
        or int w: the w most recent keys, the query's own included), rope_theta (None: no
        rotary), max_position_embeddings (accepted, unused), layer_idx. Ours: norm_eps.
        Flax's: dtype (compute; None = the input's), param_dtype, rngs.
    Parameters: q_proj, k_proj, v_proj (+ biases with qkv_bias), o_proj, q_norm.weight /
        k_norm.weight (qk_norm) -- torch names and shapes.
    __call__(hidden_states [B, T, hidden], attention_mask=None, past_key_values=None,
        use_cache=False, cu_seqlens=None, max_cache_len=None) -> (o [B, T, hidden], None,
        cache dict or None); the cache is layers/kv_cache.py's, preallocated: max_cache_len
        (int) is its capacity in tokens when this call creates it (default: T + 256 rounded
        up to a multiple of 256); a decode step keeps its shapes, so a jitted step compiles
        once. Padding as fla_torch.layers.Attention.
    """

    def __init__(self, hidden_size: int = 2048, num_heads: int = 32,
                 num_kv_heads: int | None = None, qkv_bias: bool = False, qk_norm: bool = False,
                 window_size: int | None = None, rope_theta: float | None = 10000.0,
                 max_position_embeddings: int | None = None, layer_idx: int | None = None,
                 norm_eps: float = 1e-5, *, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        name = "Attention"
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % self.num_kv_heads != 0:
            raise ValueError(f"{name}: num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if hidden_size % num_heads != 0:
            raise ValueError(f"{name}: hidden_size={hidden_size} is not divisible by "
                             f"num_heads={num_heads}")
        if window_size is not None and (not isinstance(window_size, int) or window_size < 1):
            raise ValueError(f"{name}: window_size={window_size!r}; expected None or an int >= 1")
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.kv_dim = self.num_kv_heads * self.head_dim
        self.qkv_bias, self.qk_norm = qkv_bias, qk_norm
        self.window_size, self.rope_theta = window_size, rope_theta
        self.max_position_embeddings, self.layer_idx = max_position_embeddings, layer_idx
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        f = {"dtype": self.dtype, "param_dtype": self.param_dtype, "rngs": rngs}
        self.q_proj = Linear(hidden_size, hidden_size, bias=qkv_bias, **f)
        self.k_proj = Linear(hidden_size, self.kv_dim, bias=qkv_bias, **f)
        self.v_proj = Linear(hidden_size, self.kv_dim, bias=qkv_bias, **f)
        self.o_proj = Linear(hidden_size, hidden_size, bias=False, **f)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=norm_eps, **f)
            self.k_norm = RMSNorm(self.head_dim, eps=norm_eps, **f)

    def __call__(self, hidden_states, attention_mask=None, past_key_values=None,
                 use_cache: bool = False, cu_seqlens=None, max_cache_len=None, **kwargs):
        name = "Attention"
        mask = check_layer_call(self, name, hidden_states, attention_mask, None, cu_seqlens)
        if past_key_values is not None:
            check_kv_cache(self, name, past_key_values, hidden_states.shape[0])
        check_max_cache_len_use(name, max_cache_len, use_cache, None if past_key_values is None
                                else past_key_values["attn_state"][0].shape[1])
        if cu_seqlens is not None and (use_cache or past_key_values is not None):
            raise ValueError(f"{name}: use_cache / past_key_values with cu_seqlens; the KV "
                             f"cache holds padded rows: decode a batch with attention_mask")
        offset = 0 if past_key_values is None else past_key_values.get("offset", 0)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.dtype)
        context_parallel.refuse("Attention", "softmax attention")
        x = hidden_states.astype(cd)
        D = self.head_dim
        q = split_heads(self.q_proj(x, cd), D)
        k = split_heads(self.k_proj(x, cd), D)
        v = split_heads(self.v_proj(x, cd), D)
        if self.qk_norm:
            q, k = self.q_norm(q).astype(cd), self.k_norm(k).astype(cd)
        if self.rope_theta is not None:
            pos = (masked_positions(mask, offset) if mask is not None else
                   rotary_positions(B, T, offset, cu_seqlens))
            q, k = apply_rotary(q, pos, self.rope_theta), apply_rotary(k, pos, self.rope_theta)
        bad = None
        if past_key_values is None:
            if mask is None:
                o = attention(q, k, v, causal=True, cu_seqlens=cu_seqlens,
                              window_size=self.window_size)
            else:
                o = attention_with_key_mask(q, k, v, mask, causal=True,
                                            window_size=self.window_size)
        else:
            kb, vb, mb, L, _ = write_kv(name, past_key_values, k, v, mask)
            o = attention_with_key_mask(q, kb, vb, mb, causal=True, window_size=self.window_size,
                                        q_offset=L)
            bad = overflowed(L, T, kb.shape[1])
        o = self.o_proj(o.reshape(B, T, -1), cd)
        if mask is not None:
            o = neutralise(mask, o)
        if bad is not None:
            o = jnp.where(bad, jnp.asarray(jnp.nan, o.dtype), o)
        if not use_cache:
            return o, None, None
        offset = next_offset(offset, T, cu_seqlens, mask)
        if past_key_values is None:
            return o, None, new_kv_cache(name, k, v, mask, offset, T, max_cache_len)
        return o, None, {"attn_state": (kb, vb), "attn_mask": mb, "length": L + T,
                         "offset": offset}
