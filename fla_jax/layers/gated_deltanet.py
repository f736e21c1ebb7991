"""GatedDeltaNet for Flax NNX (FLA's class name, constructor arguments and parameter names;
the same parameters, shapes and arithmetic as fla_torch.layers.GatedDeltaNet).

Per token: q, k = silu(conv(proj(x))) in H heads of K = head_dim; v likewise in HV =
num_v_heads heads of V = head_dim * expand_v (value head hv reads q/k head hv // (HV // H));
g = -exp(A_log) * softplus(a_proj(x) + dt_bias), beta = sigmoid(b_proj(x)) (x2 with
allow_neg_eigval), both float32; the gated delta rule with q/k L2-normalised; the output
RMSNorm gated by g_proj(x) (use_gate); o_proj.
"""
from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from ..modules import FusedRMSNormGated, Linear, RMSNorm, ShortConvolution
from ..modules.precision import canonical, compute_dtype
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import (call_op, check_mode, effective_mode, flatten_heads, project_qkv,
                          split_heads)


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet layer.

    Args (FLA's): hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode, use_gate,
        use_short_conv, allow_neg_eigval, conv_size, conv_bias, layer_idx, norm_eps.
        Flax's: dtype (compute; None = the input's dtype), param_dtype (storage), rngs.
    Parameters (torch names, torch shapes): q_proj.weight [H*K, hidden], k_proj, v_proj
        [HV*V, hidden], a_proj, b_proj [HV, hidden], A_log, dt_bias [HV], q/k/v_conv1d.weight
        [D, 1, W], g_proj (use_gate), o_norm.weight [V], o_proj [hidden, HV*V].
    __call__(hidden_states [B, T, hidden], attention_mask=None, past_key_values=None,
        use_cache=False) -> (o [B, T, hidden], None, cache dict or None); see layers/cache.py.
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256,
                 num_heads: int = 6, num_v_heads: int | None = None, mode: str = "chunk",
                 use_gate: bool = True, use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 layer_idx: int | None = None, norm_eps: float = 1e-5, *, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs, **kwargs):
        name = "GatedDeltaNet"
        self.mode = check_mode(name, mode, ("chunk", "fused_recurrent"))
        self.hidden_size, self.expand_v, self.head_dim = hidden_size, expand_v, head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.use_gate, self.use_short_conv = use_gate, use_short_conv
        self.allow_neg_eigval = allow_neg_eigval
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.layer_idx = layer_idx
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        self.key_dim = num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"{name}: expand_v={expand_v} with head_dim={head_dim} gives a "
                             f"non-integer value head size {head_dim * expand_v}")
        if self.num_v_heads % num_heads != 0:
            raise ValueError(f"{name}: num_v_heads={self.num_v_heads}; expected a multiple of "
                             f"num_heads={num_heads} (grouped value heads)")
        f = {"dtype": self.dtype, "param_dtype": self.param_dtype, "rngs": rngs}
        self.q_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.v_proj = Linear(hidden_size, self.value_dim, bias=False, **f)
        self.a_proj = Linear(hidden_size, self.num_v_heads, bias=False, **f)
        self.b_proj = Linear(hidden_size, self.num_v_heads, bias=False, **f)
        HV = self.num_v_heads
        A = jax.random.uniform(rngs.params(), (HV,), jnp.float32, 0.0, 16.0)
        self.A_log = nnx.Param(jnp.log(A).astype(self.param_dtype))
        u = jax.random.uniform(rngs.params(), (HV,), jnp.float32)
        dt = jnp.maximum(jnp.exp(u * (math.log(0.1) - math.log(0.001)) + math.log(0.001)), 1e-4)
        self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(self.param_dtype))
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **f)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **f)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, **f)
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

    def gates(self, x):
        """float32 (g [B, T, HV] log-decay, beta [B, T, HV]) from x [B, T, hidden]."""
        a = self.a_proj(x, jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a + self.dt_bias[...].astype(jnp.float32))
        beta = jax.nn.sigmoid(self.b_proj(x, jnp.float32))
        if self.allow_neg_eigval:
            beta = beta * 2.0
        return g, beta

    def __call__(self, hidden_states, attention_mask=None, past_key_values=None,
                 use_cache: bool = False, cu_seqlens=None, **kwargs):
        mask = check_layer_call(self, "GatedDeltaNet", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.dtype)
        x = hidden_states.astype(cd)
        state, conv_cache, offset = read_cache("GatedDeltaNet", past_key_values,
                                               self.use_short_conv)
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
        o, state = call_op("gated_delta_rule", mode, q, k, v, g=g, beta=beta,
                           initial_state=state, output_final_state=use_cache, cu_seqlens=cu_seqlens,
                           use_qk_l2norm_in_kernel=True)
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
