"""KimiDeltaAttention (FLA's class name, constructor arguments and parameter names).

Per token: q, k = silu(conv(proj(x))) in H heads of K = head_dim; v likewise in HV =
num_v_heads heads of V = head_dim * expand_v (value head hv reads q/k head hv // (HV // H));
a per-key log-decay g [B, T, HV, K] from the low-rank f_proj:
    g = -exp(A_log) * softplus(f_proj(x) + dt_bias)                       (default)
    g = lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))          (lower_bound set)
beta = sigmoid(b_proj(x)) (x2 with allow_neg_eigval); g and beta computed in float32; the KDA
op with q/k L2-normalised in the op; then o_norm(o, g_proj(x)) (RMSNorm gated by a sigmoid)
and o_proj.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..modules import FusedRMSNormGated, ShortConvolution
from ..modules.precision import (compute_dtype, linear, linear_fp32, no_autocast, output_dtype,
                                 resolve_policy, storage_dtype)
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import call_op, check_mode, effective_mode, project_qkv, split_heads

NAME = "KimiDeltaAttention"


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer.

    Args (FLA's): hidden_size, expand_v, head_dim, num_heads, num_v_heads (None = num_heads;
        a multiple of num_heads), mode ('chunk' | 'fused_recurrent'), use_short_conv,
        allow_neg_eigval, safe_gate (A_log starts at 0; needs lower_bound in [-5, 0)),
        lower_bound, conv_size, conv_bias, layer_idx, norm_eps.
        Ours: device, dtype (parameter storage), policy (compute DtypePolicy or string).
    Parameters: q_proj, k_proj [H*K, hidden]; v_proj [HV*V, hidden]; q/k/v_conv1d
        (use_short_conv); f_proj.0 [V, hidden], f_proj.1 [HV*K, V]; b_proj [HV, hidden];
        A_log [HV]; dt_bias [HV*K]; g_proj.0 [V, hidden], g_proj.1 [HV*V, V] + bias;
        o_norm.weight [V]; o_proj [hidden, HV*V].
    forward(hidden_states [B, T, hidden], attention_mask=None, past_key_values=None,
        use_cache=False, cu_seqlens=None) -> (o [B, T, hidden], None, cache dict or None); the
        cache's recurrent_state is [N, HV, K, V] fp32 (FLA's layer keeps [N, HV, V, K]).
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128,
                 num_heads: int = 16, num_v_heads: int | None = None, mode: str = "chunk",
                 use_short_conv: bool = True, allow_neg_eigval: bool = False,
                 safe_gate: bool = False, lower_bound: float | None = None, conv_size: int = 4,
                 conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5,
                 device=None, dtype=None, policy=None, **kwargs):
        super().__init__()
        self.mode = check_mode(NAME, mode, ("chunk", "fused_recurrent"))
        self.hidden_size, self.expand_v, self.head_dim = hidden_size, expand_v, head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.allow_neg_eigval, self.safe_gate = allow_neg_eigval, safe_gate
        self.lower_bound = lower_bound
        self.layer_idx = layer_idx
        self.policy = resolve_policy(policy)
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
        dtype = storage_dtype(dtype, self.policy)
        f = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **f)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **f)
        if use_short_conv:
            for proj, size in (("q", self.key_dim), ("k", self.key_dim), ("v", self.value_dim)):
                setattr(self, f"{proj}_conv1d", ShortConvolution(
                    size, conv_size, bias=conv_bias, activation="silu", policy=self.policy, **f))
        self.v_silu_without_conv = True
        self.f_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False, **f),
            nn.Linear(self.head_v_dim, self.gate_dim, bias=False, **f))
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False, **f)
        if safe_gate:
            A_log = torch.zeros(self.num_v_heads)
        else:
            A_log = torch.log(torch.empty(self.num_v_heads).uniform_(1, 16))
        self.A_log = nn.Parameter(A_log.to(device=device, dtype=dtype))
        self.A_log._no_weight_decay = True
        dt = torch.exp(torch.rand(self.gate_dim) * (math.log(0.1) - math.log(0.001))
                       + math.log(0.001)).clamp(min=1e-4)
        inv_dt = dt + torch.log(-torch.expm1(-dt))          # softplus^-1(dt)
        self.dt_bias = nn.Parameter(inv_dt.to(device=device, dtype=dtype))
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False, **f),
            nn.Linear(self.head_v_dim, self.value_dim, bias=True, **f))
        self.o_norm = FusedRMSNormGated(self.head_v_dim, activation="sigmoid", eps=norm_eps,
                                        policy=self.policy, **f)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **f)

    def gates(self, x: torch.Tensor):
        """float32 (g [B, T, HV, K] per-key log-decay, beta [B, T, HV]) from x [B, T, hidden]."""
        with no_autocast(x):
            f = linear_fp32(linear_fp32(x, self.f_proj[0]), self.f_proj[1])
            f = split_heads(f + self.dt_bias.float(), self.head_k_dim)       # [B, T, HV, K]
            A = torch.exp(self.A_log.float())[:, None]
            if self.lower_bound is None:
                g = -A * F.softplus(f)
            else:
                g = self.lower_bound * torch.sigmoid(A * f)
            beta = torch.sigmoid(linear_fp32(x, self.b_proj))
            if self.allow_neg_eigval:
                beta = beta * 2.0
        return g, beta

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, cu_seqlens=None,
                **kwargs):
        mask = check_layer_call(self, NAME, hidden_states, attention_mask, past_key_values,
                                cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.policy)
        x = hidden_states.to(cd)
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
        gate = split_heads(linear(linear(x, self.g_proj[0], cd), self.g_proj[1], cd),
                           self.head_v_dim)
        o = self.o_norm(o, gate)
        o = linear(o.flatten(-2), self.o_proj, cd).to(output_dtype(cd, self.policy))
        if mask is not None:
            o = neutralise(mask, o)
        cache = (make_cache(state, conv_state, next_offset(offset, T, cu_seqlens, mask))
                 if use_cache else None)
        return o, None, cache
