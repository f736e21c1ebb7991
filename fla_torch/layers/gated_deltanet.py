"""GatedDeltaNet (FLA's class name, constructor arguments and parameter names).

Per token: q, k = silu(conv(proj(x))) split into H heads of K = head_dim; v likewise into HV =
num_v_heads heads of V = head_dim * expand_v (value head hv reads q/k head hv // (HV // H));
g = -exp(A_log) * softplus(a_proj(x) + dt_bias) and beta = sigmoid(b_proj(x)) (x2 with
allow_neg_eigval), both float32; the gated delta rule with q/k L2-normalised; then an output
RMSNorm gated by g_proj(x) (use_gate) and o_proj.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..modules import FusedRMSNormGated, RMSNorm, ShortConvolution
from ..modules.precision import (compute_dtype, linear, linear_fp32, no_autocast, output_dtype,
                                 resolve_policy, storage_dtype)
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import call_op, check_mode, effective_mode, project_qkv, split_heads


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet layer.

    Args (FLA's): hidden_size, expand_v, head_dim, num_heads, num_v_heads (None = num_heads;
        a multiple of num_heads), mode ('chunk' | 'fused_recurrent'), use_gate, use_short_conv,
        allow_neg_eigval, conv_size, conv_bias, layer_idx, norm_eps.
        Ours: device, dtype (parameter storage), policy (compute DtypePolicy or string).
    Parameters: q_proj, k_proj [H*K, hidden]; v_proj [HV*V, hidden]; a_proj, b_proj [HV, hidden];
        A_log, dt_bias [HV]; q_conv1d, k_conv1d, v_conv1d (weight [D, 1, conv_size]);
        g_proj [HV*V, hidden] (use_gate); o_norm.weight [V]; o_proj [hidden, HV*V].
    forward(hidden_states [B, T, hidden], attention_mask=None, past_key_values=None,
        use_cache=False) -> (o [B, T, hidden], None, cache dict or None); see layers/cache.py.
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256,
                 num_heads: int = 6, num_v_heads: int | None = None, mode: str = "chunk",
                 use_gate: bool = True, use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 layer_idx: int | None = None, norm_eps: float = 1e-5, device=None, dtype=None,
                 policy=None, **kwargs):
        super().__init__()
        name = "GatedDeltaNet"
        self.mode = check_mode(name, mode, ("chunk", "fused_recurrent"))
        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.use_gate = use_gate
        self.use_short_conv = use_short_conv
        self.allow_neg_eigval = allow_neg_eigval
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.layer_idx = layer_idx
        self.policy = resolve_policy(policy)
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
        dtype = storage_dtype(dtype, self.policy)
        f = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **f)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **f)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False, **f)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False, **f)
        A = torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(0, 16)
        self.A_log = nn.Parameter(torch.log(A).to(device=device, dtype=dtype))
        self.A_log._no_weight_decay = True
        dt = torch.exp(torch.rand(self.num_v_heads) * (math.log(0.1) - math.log(0.001))
                       + math.log(0.001)).clamp(min=1e-4)
        inv_dt = dt + torch.log(-torch.expm1(-dt))          # softplus^-1(dt)
        self.dt_bias = nn.Parameter(inv_dt.to(device=device, dtype=dtype))
        self.dt_bias._no_weight_decay = True
        if use_short_conv:
            for proj, size in (("q", self.key_dim), ("k", self.key_dim), ("v", self.value_dim)):
                setattr(self, f"{proj}_conv1d", ShortConvolution(
                    size, conv_size, bias=conv_bias, activation="silu", policy=self.policy, **f))
        else:
            warnings.warn(f"{name}: use_short_conv=False; short convolutions matter for quality",
                          stacklevel=2)
        self.v_silu_without_conv = True
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **f)
            self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=norm_eps, policy=self.policy,
                                            **f)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, policy=self.policy, **f)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **f)

    def gates(self, x: torch.Tensor):
        """float32 (g [B, T, HV] log-decay, beta [B, T, HV]) from x [B, T, hidden]."""
        with no_autocast(x):
            a = linear_fp32(x, self.a_proj)
            g = -torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())
            beta = torch.sigmoid(linear_fp32(x, self.b_proj))
            if self.allow_neg_eigval:
                beta = beta * 2.0
        return g, beta

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, cu_seqlens=None,
                **kwargs):
        mask = check_layer_call(self, "GatedDeltaNet", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.policy)
        x = hidden_states.to(cd)
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
            o = self.o_norm(o, split_heads(linear(x, self.g_proj, cd), self.head_v_dim))
        else:
            o = self.o_norm(o)
        o = linear(o.flatten(-2), self.o_proj, cd).to(output_dtype(cd, self.policy))
        if mask is not None:
            o = neutralise(mask, o)
        cache = (make_cache(state, conv_state, next_offset(offset, T, cu_seqlens, mask))
                 if use_cache else None)
        return o, None, cache
