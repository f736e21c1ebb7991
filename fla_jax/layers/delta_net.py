"""DeltaNet for Flax NNX (FLA's class name, constructor arguments and parameter names; the same
parameters, shapes and arithmetic as fla_torch.layers.DeltaNet)."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from ..modules import FusedRMSNormGated, Linear, RMSNorm, ShortConvolution
from ..modules.precision import canonical, compute_dtype
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import (activate, call_op, check_mode, effective_mode, flatten_heads,
                          project_qkv, split_heads)

_QK_ACT = {"silu": None, "relu": "relu", "elu": "elu_p1", "identity": None}


def sum_normalize(x):
    """x / sum(x) over the last axis, in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    return (xf / jnp.sum(xf, axis=-1, keepdims=True)).astype(x.dtype)


class DeltaNet(nnx.Module):
    """DeltaNet layer.

    Args (FLA's): mode, d_model, hidden_size, expand_k, expand_v, num_heads, use_beta, use_gate,
        use_short_conv, conv_size, conv_bias, allow_neg_eigval, layer_idx, qk_activation,
        qk_norm, norm_eps. Flax's: dtype, param_dtype, rngs.
    Parameters: q_proj, k_proj, v_proj, b_proj (use_beta), q/k/v_conv1d, g_proj (use_gate),
        o_norm.weight, o_proj -- torch names and shapes.
    __call__ -> (o [B, T, hidden], None, cache dict or None); see layers/cache.py.
    """

    def __init__(self, mode: str = "chunk", d_model: int | None = None, hidden_size: int = 1024,
                 expand_k: float = 1.0, expand_v: float = 1.0, num_heads: int = 4,
                 use_beta: bool = True, use_gate: bool = False, use_short_conv: bool = True,
                 conv_size: int = 4, conv_bias: bool = False, allow_neg_eigval: bool = False,
                 layer_idx: int | None = None, qk_activation: str = "silu", qk_norm: str = "l2",
                 norm_eps: float = 1e-5, *, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs, **kwargs):
        name = "DeltaNet"
        self.mode = check_mode(name, mode, ("chunk", "fused_recurrent"))
        if qk_activation not in _QK_ACT:
            raise ValueError(f"{name}: qk_activation={qk_activation!r}; expected one of "
                             f"{', '.join(_QK_ACT)}")
        if qk_norm not in ("l2", "sum"):
            raise ValueError(f"{name}: qk_norm={qk_norm!r}; expected 'l2' or 'sum'")
        if d_model is not None:
            hidden_size = d_model
        self.hidden_size = hidden_size
        self.expand_k, self.expand_v = expand_k, expand_v
        self.num_heads = num_heads
        self.use_beta, self.use_gate = use_beta, use_gate
        self.use_short_conv = use_short_conv
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.allow_neg_eigval = allow_neg_eigval
        self.layer_idx = layer_idx
        self.qk_activation, self.qk_norm = qk_activation, qk_norm
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        for dim_name, dim in (("key_dim", self.key_dim), ("value_dim", self.value_dim)):
            if dim % num_heads != 0:
                raise ValueError(f"{name}: {dim_name}={dim} is not divisible by "
                                 f"num_heads={num_heads}")
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        f = {"dtype": self.dtype, "param_dtype": self.param_dtype, "rngs": rngs}
        self.q_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.v_proj = Linear(hidden_size, self.value_dim, bias=False, **f)
        if use_beta:
            self.b_proj = Linear(hidden_size, num_heads, bias=False, **f)
        if use_short_conv:
            qk_act = "silu" if qk_activation == "silu" else None
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias,
                                             activation=qk_act, **f)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias,
                                             activation=qk_act, **f)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias,
                                             activation="silu", **f)
        else:
            warnings.warn(f"{name}: use_short_conv=False; short convolutions matter for quality",
                          stacklevel=2)
        self.v_silu_without_conv = True
        if use_gate:
            self.g_proj = Linear(hidden_size, self.value_dim, bias=False, **f)
            self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=norm_eps, **f)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, **f)
        self.o_proj = Linear(self.value_dim, hidden_size, bias=False, **f)

    def __call__(self, hidden_states, attention_mask=None, past_key_values=None,
                 use_cache: bool = False, cu_seqlens=None, **kwargs):
        mask = check_layer_call(self, "DeltaNet", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.dtype)
        x = hidden_states.astype(cd)
        state, conv_cache, offset = read_cache("DeltaNet", past_key_values, self.use_short_conv)
        mode = effective_mode(self.mode, past_key_values, T)
        q, k, v, conv_state = project_qkv(self, x, cd, conv_cache, use_cache,
                                          qk_silu_without_conv=self.qk_activation == "silu",
                                          cu_seqlens=cu_seqlens, mask=mask)
        q, k = split_heads(q, self.head_k_dim), split_heads(k, self.head_k_dim)
        v = split_heads(v, self.head_v_dim)
        act = _QK_ACT[self.qk_activation]
        q, k = activate(q, act), activate(k, act)
        if self.qk_norm == "sum":
            q, k = sum_normalize(q), sum_normalize(k)
        if self.use_beta:
            beta = jax.nn.sigmoid(self.b_proj(x, jnp.float32))
        else:
            beta = jnp.ones((B, T, self.num_heads), jnp.float32)
        if self.allow_neg_eigval:
            beta = beta * 2.0
        if mask is not None:
            k, v, beta = neutralise(mask, k), neutralise(mask, v), neutralise(mask, beta)
        o, state = call_op("delta_rule", mode, q, k, v, beta=beta, initial_state=state,
                           output_final_state=use_cache, cu_seqlens=cu_seqlens,
                           use_qk_l2norm_in_kernel=self.qk_norm == "l2")
        if self.use_gate:
            o = self.o_norm(o, split_heads(self.g_proj(x, cd), self.head_v_dim))
        else:
            o = self.o_norm(o)
        o = self.o_proj(flatten_heads(o).astype(cd), cd)
        if mask is not None:
            o = neutralise(mask, o)
        cache = (make_cache(state, conv_state, next_offset(offset, T, cu_seqlens, mask))
                 if use_cache else None)
        return o, None, cache
