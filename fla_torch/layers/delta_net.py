"""DeltaNet (FLA's class name, constructor arguments and parameter names).

Per token: q, k, v = conv(proj(x)) split into H heads (q/k activation `qk_activation`, v silu),
beta = sigmoid(b_proj(x)) in float32 (ones without use_beta; x2 with allow_neg_eigval), the
delta rule (q/k L2-normalised inside the op when qk_norm='l2', divided by their sum when
'sum'), an output RMSNorm (gated by g_proj(x) with use_gate) and o_proj.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ..modules import FusedRMSNormGated, RMSNorm, ShortConvolution
from ..modules.precision import (compute_dtype, linear, linear_fp32, no_autocast, output_dtype,
                                 resolve_policy, storage_dtype)
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import activate, call_op, check_mode, effective_mode, project_qkv, split_heads

_QK_ACT = {"silu": None, "relu": "relu", "elu": "elu_p1", "identity": None}


def sum_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sum(x) over the last dim, in float32, returned in x's dtype."""
    with no_autocast(x):
        xf = x.float()
        return (xf / xf.sum(-1, keepdim=True)).to(x.dtype)


class DeltaNet(nn.Module):
    """DeltaNet layer.

    Args (FLA's): mode ('chunk' | 'fused_recurrent'), d_model (alias of hidden_size),
        hidden_size, expand_k, expand_v, num_heads, use_beta, use_gate, use_short_conv,
        conv_size, conv_bias, allow_neg_eigval, layer_idx, qk_activation ('silu' | 'relu' |
        'elu' | 'identity'), qk_norm ('l2' | 'sum'), norm_eps.
        Ours: device, dtype (parameter storage), policy (compute DtypePolicy or string).
    Parameters: q_proj, k_proj [key_dim, hidden]; v_proj [value_dim, hidden]; b_proj [H, hidden]
        (use_beta); q_conv1d, k_conv1d, v_conv1d; g_proj (use_gate); o_norm.weight [V]; o_proj.
    forward -> (o [B, T, hidden], None, cache dict or None); see layers/cache.py.
    """

    def __init__(self, mode: str = "chunk", d_model: int | None = None, hidden_size: int = 1024,
                 expand_k: float = 1.0, expand_v: float = 1.0, num_heads: int = 4,
                 use_beta: bool = True, use_gate: bool = False, use_short_conv: bool = True,
                 conv_size: int = 4, conv_bias: bool = False, allow_neg_eigval: bool = False,
                 layer_idx: int | None = None, qk_activation: str = "silu", qk_norm: str = "l2",
                 norm_eps: float = 1e-5, device=None, dtype=None, policy=None, **kwargs):
        super().__init__()
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
        self.policy = resolve_policy(policy)
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        for dim_name, dim in (("key_dim", self.key_dim), ("value_dim", self.value_dim)):
            if dim % num_heads != 0:
                raise ValueError(f"{name}: {dim_name}={dim} is not divisible by "
                                 f"num_heads={num_heads}")
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        dtype = storage_dtype(dtype, self.policy)
        f = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **f)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **f)
        if use_beta:
            self.b_proj = nn.Linear(hidden_size, num_heads, bias=False, **f)
        if use_short_conv:
            qk_conv_act = "silu" if qk_activation == "silu" else None
            for proj, size, act in (("q", self.key_dim, qk_conv_act),
                                    ("k", self.key_dim, qk_conv_act),
                                    ("v", self.value_dim, "silu")):
                setattr(self, f"{proj}_conv1d", ShortConvolution(
                    size, conv_size, bias=conv_bias, activation=act, policy=self.policy, **f))
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

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None,
                use_cache: bool = False, output_attentions: bool = False, cu_seqlens=None,
                **kwargs):
        mask = check_layer_call(self, "DeltaNet", hidden_states, attention_mask,
                                past_key_values, cu_seqlens)
        B, T, _ = hidden_states.shape
        cd = compute_dtype(hidden_states, self.policy)
        x = hidden_states.to(cd)
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
        with no_autocast(x):
            if self.use_beta:
                beta = torch.sigmoid(linear_fp32(x, self.b_proj))
            else:
                beta = torch.ones(B, T, self.num_heads, dtype=torch.float32, device=x.device)
            if self.allow_neg_eigval:
                beta = beta * 2.0
        if mask is not None:
            k, v, beta = neutralise(mask, k), neutralise(mask, v), neutralise(mask, beta)
        o, state = call_op("delta_rule", mode, q, k, v, beta=beta, initial_state=state,
                           output_final_state=use_cache, cu_seqlens=cu_seqlens,
                           use_qk_l2norm_in_kernel=self.qk_norm == "l2")
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
