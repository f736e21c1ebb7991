"""KimiDeltaAttention for Flax NNX (FLA's class name, constructor arguments and parameter
names; the same parameters, shapes and arithmetic as fla_torch.layers.KimiDeltaAttention).

Per token: q, k = silu(conv(proj(x))) in H heads of K = head_dim; v likewise in HV =
num_v_heads heads of V = head_dim * expand_v; a per-key log-decay g [B, T, HV, K]:
    g = -exp(A_log) * softplus(f_proj(x) + dt_bias)                       (default)
    g = lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))          (lower_bound set)
beta = sigmoid(b_proj(x)) (x2 with allow_neg_eigval); g and beta in float32; the KDA op with
q/k L2-normalised in the op; o_norm(o, g_proj(x)) (RMSNorm gated by a sigmoid); o_proj.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..modules import FusedRMSNormGated, Linear, ShortConvolution
from ..modules.precision import canonical, compute_dtype
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import (call_op, check_mode, effective_mode, flatten_heads, project_qkv,
                          split_heads)

NAME = "KimiDeltaAttention"


class KimiDeltaAttention(nnx.Module):
    """Kimi Delta Attention layer.

    Args (FLA's): hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode,
        use_short_conv, allow_neg_eigval, safe_gate, lower_bound, conv_size, conv_bias,
        layer_idx, norm_eps. Flax's: dtype (compute; None = the input's), param_dtype, rngs.
    Parameters (torch names, torch shapes): q_proj, k_proj [H*K, hidden]; v_proj [HV*V,
        hidden]; q/k/v_conv1d; f_proj.0 [V, hidden], f_proj.1 [HV*K, V]; b_proj [HV, hidden];
        A_log [HV]; dt_bias [HV*K]; g_proj.0 [V, hidden], g_proj.1 [HV*V, V] + bias;
        o_norm.weight [V]; o_proj [hidden, HV*V].
    __call__(hidden_states [B, T, hidden], attention_mask=None, past_key_values=None,
        use_cache=False, cu_seqlens=None) -> (o [B, T, hidden], None, cache dict or None).
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128,
                 num_heads: int = 16, num_v_heads: int | None = None, mode: str = "chunk",
                 use_short_conv: bool = True, allow_neg_eigval: bool = False,
                 safe_gate: bool = False, lower_bound: float | None = None, conv_size: int = 4,
                 conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5,
                 *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs, **kwargs):
        self.mode = check_mode(NAME, mode, ("chunk", "fused_recurrent"))
        self.hidden_size, self.expand_v, self.head_dim = hidden_size, expand_v, head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.allow_neg_eigval, self.safe_gate = allow_neg_eigval, safe_gate
        self.lower_bound = lower_bound
        self.layer_idx = layer_idx
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        self.key_dim = num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.gate_dim = self.num_v_heads * self.head_k_dim
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"{NAME}: expand_v={expand_v} with head_dim={head_dim} gives a "
                             f"non-integer value head size {head_dim * expand_v}")
        if self.num_v_heads % num_heads != 0:
            raise ValueError(f"{NAME}: num_v_heads={self.num_v_heads}; expected a multiple of "
                             f"num_heads={num_heads} (grouped value heads)")
        if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError(f"{NAME}: safe_gate=True with lower_bound={lower_bound}; expected "
                             f"a lower_bound in [-5, 0) (FLA's chunk_kda requires it)")
        f = {"dtype": self.dtype, "param_dtype": self.param_dtype, "rngs": rngs}
        self.q_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.v_proj = Linear(hidden_size, self.value_dim, bias=False, **f)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **f)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **f)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, **f)
        self.v_silu_without_conv = True
        self.f_proj = nnx.List([Linear(hidden_size, self.head_v_dim, bias=False, **f),
                                Linear(self.head_v_dim, self.gate_dim, bias=False, **f)])
        self.b_proj = Linear(hidden_size, self.num_v_heads, bias=False, **f)
        HV = self.num_v_heads
        if safe_gate:
            A_log = jnp.zeros((HV,), jnp.float32)
        else:
            A_log = jnp.log(jax.random.uniform(rngs.params(), (HV,), jnp.float32, 1.0, 16.0))
        self.A_log = nnx.Param(A_log.astype(self.param_dtype))
        u = jax.random.uniform(rngs.params(), (self.gate_dim,), jnp.float32)
        dt = jnp.maximum(jnp.exp(u * (math.log(0.1) - math.log(0.001)) + math.log(0.001)), 1e-4)
        self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(self.param_dtype))
        self.g_proj = nnx.List([Linear(hidden_size, self.head_v_dim, bias=False, **f),
                                Linear(self.head_v_dim, self.value_dim, bias=True, **f)])
        self.o_norm = FusedRMSNormGated(self.head_v_dim, activation="sigmoid", eps=norm_eps,
                                        **f)
        self.o_proj = Linear(self.value_dim, hidden_size, bias=False, **f)

    def gates(self, x):
        """float32 (g [B, T, HV, K] per-key log-decay, beta [B, T, HV]) from x [B, T, hidden]."""
        f = self.f_proj[1](self.f_proj[0](x, jnp.float32), jnp.float32)
        f = split_heads(f + self.dt_bias[...].astype(jnp.float32), self.head_k_dim)
        A = jnp.exp(self.A_log[...].astype(jnp.float32))[:, None]
        if self.lower_bound is None:
            g = -A * jax.nn.softplus(f)
        else:
            g = self.lower_bound * jax.nn.sigmoid(A * f)
        beta = jax.nn.sigmoid(self.b_proj(x, jnp.float32))
        if self.allow_neg_eigval:
            beta = beta * 2.0
        return g, beta

    def __call__(self, hidden_states, attention_mask=None, past_key_values=None,
                 use_cache: bool = False, cu_seqlens=None, **kwargs):
        mask = check_layer_call(self, NAME, hidden_states, attention_mask, past_key_values,
                                cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.dtype)
        x = hidden_states.astype(cd)
        state, conv_cache, offset = read_cache(NAME, past_key_values, self.use_short_conv)
        mode = effective_mode(self.mode, past_key_values, T)
        q, k, v, conv_state = project_qkv(self, x, cd, conv_cache, use_cache,
                                          qk_silu_without_conv=True, cu_seqlens=cu_seqlens,
                                          mask=mask)
        q, k = split_heads(q, self.head_k_dim), split_heads(k, self.head_k_dim)
        v = split_heads(v, self.head_v_dim)
        g, beta = self.gates(x)
        if mask is not None:
            k, v = neutralise(mask, k), neutralise(mask, v)
            g, beta = neutralise(mask, g), neutralise(mask, beta)
        o, state = call_op("kda", mode, q, k, v, g=g, beta=beta, initial_state=state,
                           output_final_state=use_cache, cu_seqlens=cu_seqlens,
                           use_qk_l2norm_in_kernel=True)
        gate = split_heads(self.g_proj[1](self.g_proj[0](x, cd), cd), self.head_v_dim)
        o = self.o_norm(o, gate)
        o = self.o_proj(flatten_heads(o).astype(cd), cd)
        if mask is not None:
            o = neutralise(mask, o)
        cache = (make_cache(state, conv_state, next_offset(offset, T, cu_seqlens, mask))
                 if use_cache else None)
        return o, None, cache
