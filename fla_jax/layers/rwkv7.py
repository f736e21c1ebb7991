"""RWKV7Attention for Flax NNX (FLA's class name, constructor arguments and parameter names;
the same parameters, shapes and arithmetic as fla_torch.layers.RWKV7Attention).

Per token t, with x' the previous token's input (token shift) and delta = x' - x:
    x_c = x + delta * x_c for c in r, w, k, v, a, g (the x_* mixing vectors)
    r = r_proj(x_r); k = k_proj(x_k); v = v_proj(x_v)
    w = -exp(-1/2) * sigmoid(w_lora(x_w))       (log-decay in [-0.607, 0], FLA's formula)
    a = sigmoid(a_lora(x_a)); kk = l2norm_per_head(k * k_k); k <- k * (1 + (a - 1) * k_a)
    layer_idx 0: v_first = v; else v <- lerp(v, v_first, sigmoid(v_lora(x_v)))
    o = RWKV-7(r, w, k, v, a=-kk, b=kk * a, scale 1); o = GroupNorm_heads(o)
    o = (o + sum_K(r * k * r_k) v) * g_lora(x_g); o_proj(o)
Dtypes (incidents 1 and 3): r, k, v in the compute dtype (mixing and the k / v updates in
float32, cast back); w, a, kk and the op's a / b in float32 from a float32 LoRA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fla_contract.layer_inputs import check_cache_shapes
from fla_contract.names import pretty
from fla_contract.rwkv7_init import rwkv7_init_values

from .. import ops
from ..dtypes import dtype_name, gate_dtype
from ..modules import Linear
from ..modules.group_norm import GroupNorm
from ..modules.lora import LoRA
from ..modules.precision import canonical, compute_dtype
from .cache import make_cache, read_cache
from .inputs import check_layer_call
from .padding import neutralise, next_offset
from .projections import check_mode, effective_mode, flatten_heads, split_heads
from .token_shift import token_shift

NAME = "RWKV7Attention"
DECAY_SCALE = -0.6065306597126334       # -exp(-1/2)
MIXES = ("r", "w", "k", "v", "a", "g")


def lora_dims(hidden_size: int, head_dim: int, decay, gate, a, v):
    """FLA's default LoRA ranks (multiples of 32, at least 32; scaled by head_dim / 64)."""
    factor = head_dim / 64
    rank = lambda c, f: max(32, int(round((c * (hidden_size ** 0.5)) * f / 32) * 32))
    return (decay if decay is not None else rank(2.5, factor),
            gate if gate is not None else rank(5, 1.0),
            a if a is not None else rank(2.5, factor),
            v if v is not None else rank(1.7, factor))


class RWKV7Attention(nnx.Module):
    """RWKV-7 time mixing.

    Args (FLA's): mode, hidden_size, head_dim / num_heads, decay_low_rank_dim,
        gate_low_rank_dim, a_low_rank_dim, v_low_rank_dim, elementwise_affine, norm_eps,
        layer_idx, fuse_norm, value_dim, num_hidden_layers (see fla_torch's docstring).
        Flax's: dtype (compute; None = the input's dtype), param_dtype (storage), rngs.
    Parameters (torch names and shapes): x_r .. x_g [1, 1, hidden]; k_k, k_a [hidden];
        r_k [H, K]; r_proj, k_proj, v_proj, o_proj; w_lora, a_lora, v_lora (layer_idx != 0),
        g_lora (lora.0 / lora.2); g_norm.weight, g_norm.bias (elementwise_affine).
    __call__(hidden_states [B, T, hidden], attention_mask=None, past_key_values=None,
        use_cache=False, v_first=None, cu_seqlens=None) -> (o, None, cache or None,
        v_first [B, T, value_dim]); cache: recurrent_state [N, H, K, V] fp32, conv_state None,
        shift_state [N, hidden], offset.
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, head_dim: int | None = 64,
                 num_heads: int | None = None, decay_low_rank_dim: int | None = None,
                 gate_low_rank_dim: int | None = None, a_low_rank_dim: int | None = None,
                 v_low_rank_dim: int | None = None, elementwise_affine: bool | None = True,
                 norm_eps: float = 1e-5, layer_idx: int | None = None, fuse_norm: bool = False,
                 value_dim: int | None = None, num_hidden_layers: int | None = None, *,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs, **kwargs):
        self.mode = check_mode(NAME, mode, ("chunk", "fused_recurrent"))
        self.hidden_size = hidden_size
        self.key_dim = hidden_size
        self.value_dim = value_dim if value_dim is not None else hidden_size
        if head_dim is None and num_heads is None:
            raise ValueError(f"{NAME}: head_dim and num_heads are both None; expected one")
        if head_dim is not None:
            if hidden_size % head_dim:
                raise ValueError(f"{NAME}: hidden_size={hidden_size} is not divisible by "
                                 f"head_dim={head_dim}")
            self.head_dim, self.num_heads = head_dim, hidden_size // head_dim
        else:
            if hidden_size % num_heads:
                raise ValueError(f"{NAME}: hidden_size={hidden_size} is not divisible by "
                                 f"num_heads={num_heads}")
            self.head_dim, self.num_heads = hidden_size // num_heads, num_heads
        if self.value_dim % self.num_heads:
            raise ValueError(f"{NAME}: value_dim={self.value_dim} is not divisible by "
                             f"num_heads={self.num_heads}")
        self.head_k_dim = self.head_dim
        self.head_v_dim = self.value_dim // self.num_heads
        (self.decay_low_rank_dim, self.gate_low_rank_dim, self.a_low_rank_dim,
         self.v_low_rank_dim) = lora_dims(hidden_size, self.head_dim, decay_low_rank_dim,
                                          gate_low_rank_dim, a_low_rank_dim, v_low_rank_dim)
        self.layer_idx, self.num_hidden_layers = layer_idx, num_hidden_layers
        self.fuse_norm = fuse_norm
        self.use_short_conv = False
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        f = {"dtype": self.dtype, "param_dtype": self.param_dtype, "rngs": rngs}
        pd = self.param_dtype
        for c in MIXES:
            setattr(self, f"x_{c}", nnx.Param(jnp.zeros((1, 1, hidden_size), pd)))
        self.k_k = nnx.Param(jnp.zeros((self.key_dim,), pd))
        self.k_a = nnx.Param(jnp.zeros((self.key_dim,), pd))
        self.r_k = nnx.Param(jnp.zeros((self.num_heads, self.head_dim), pd))
        self.r_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.k_proj = Linear(hidden_size, self.key_dim, bias=False, **f)
        self.v_proj = Linear(hidden_size, self.value_dim, bias=False, **f)
        self.o_proj = Linear(self.value_dim, hidden_size, bias=False, **f)
        self.w_lora = LoRA(hidden_size, self.key_dim, self.decay_low_rank_dim,
                           activation="tanh", **f)
        if layer_idx != 0:
            self.v_lora = LoRA(hidden_size, self.value_dim, self.v_low_rank_dim,
                               activation=None, **f)
        self.a_lora = LoRA(hidden_size, self.key_dim, self.a_low_rank_dim, activation=None, **f)
        self.g_lora = LoRA(hidden_size, self.value_dim, self.gate_low_rank_dim,
                           activation="sigmoid", bias=False, **f)
        self.g_norm = GroupNorm(self.num_heads, self.value_dim,
                                elementwise_affine=bool(elementwise_affine), bias=True,
                                eps=self.head_dim * norm_eps, dtype=self.dtype,
                                param_dtype=self.param_dtype)
        if layer_idx is not None and num_hidden_layers is not None:
            self.init_rwkv7(rngs)

    def init_rwkv7(self, rngs: nnx.Rngs) -> None:
        """FLA's layer-dependent initialisation (needs layer_idx and num_hidden_layers)."""
        D, pd = self.hidden_size, self.param_dtype
        vals = rwkv7_init_values(D, self.value_dim, self.head_dim, self.layer_idx,
                                 self.num_hidden_layers)
        for c in MIXES:
            getattr(self, f"x_{c}").set_value(jnp.asarray(vals[f"x_{c}"]).reshape(1, 1, D)
                                              .astype(pd))
        for name in ("k_k", "k_a", "r_k"):
            p = getattr(self, name)
            p.set_value(jnp.asarray(vals[name]).reshape(p[...].shape).astype(pd))
        self.w_lora.set_bias_value(vals["w_bias"])
        self.a_lora.set_bias_value(vals["a_bias"])
        if self.layer_idx != 0:
            self.v_lora.reset_parameters(rngs)
            self.v_lora.set_bias_value(vals["v_bias"])
        if self.g_norm.weight is not None:
            self.g_norm.weight.set_value(jnp.full_like(self.g_norm.weight[...],
                                                       vals["g_norm"]))
        for proj, gain in ((self.r_proj, 1.0), (self.k_proj, 0.1), (self.v_proj, 1.0)):
            w = jax.nn.initializers.orthogonal(scale=gain)(rngs.params(), proj.weight[...].shape,
                                                            jnp.float32)
            proj.weight.set_value(w.astype(pd))
        self.o_proj.weight.set_value(jnp.zeros_like(self.o_proj.weight[...]))

    def _check_v_first(self, v_first, B: int, T: int, cd):
        if self.layer_idx == 0:
            return
        if v_first is None:
            raise ValueError(f"{NAME}: v_first is None with layer_idx={self.layer_idx}; "
                             f"expected the [B, T, value_dim] v_first that the layer_idx=0 "
                             f"RWKV7Attention of this model returned")
        if not hasattr(v_first, "shape") or not hasattr(v_first, "dtype"):
            raise TypeError(f"{NAME}: v_first is {type(v_first).__name__}; expected an array "
                            f"[B, T, value_dim]")
        if tuple(v_first.shape) != (B, T, self.value_dim):
            raise ValueError(f"{NAME}: v_first has shape {list(v_first.shape)}; expected "
                             f"[B, T, value_dim] = [{B}, {T}, {self.value_dim}]")
        if np.dtype(v_first.dtype) != np.dtype(cd):
            raise TypeError(f"{NAME}: v_first has dtype {pretty(dtype_name(v_first.dtype))}; "
                            f"expected the compute dtype {pretty(dtype_name(cd))} (layer 0 "
                            f"returns it so)")

    def __call__(self, hidden_states, attention_mask=None, past_key_values=None,
                 use_cache: bool = False, v_first=None, cu_seqlens=None, **kwargs):
        mask = check_layer_call(self, NAME, hidden_states, attention_mask, past_key_values,
                                cu_seqlens)
        B, T, _ = hidden_states.shape
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        cd = compute_dtype(hidden_states, self.dtype)
        f32 = gate_dtype(cd)
        x = hidden_states.astype(cd)
        self._check_v_first(v_first, B, T, cd)
        state, _, offset = read_cache(NAME, past_key_values, False)
        shift = None if past_key_values is None else past_key_values.get("shift_state")
        if shift is not None:
            check_cache_shapes(NAME, [("past_key_values['shift_state']", tuple(shift.shape),
                                       (N, self.hidden_size), "[N, hidden_size]")])
        mode = effective_mode(self.mode, past_key_values, T)
        if mask is not None:
            x = neutralise(mask, x)
        prev, shift = token_shift(x, shift, mask, cu_seqlens)
        xf = x.astype(f32)
        delta = prev.astype(f32) - xf
        mixed = {c: xf + delta * getattr(self, f"x_{c}")[...].astype(f32) for c in MIXES}
        r = self.r_proj(mixed["r"].astype(cd), cd)
        k = self.k_proj(mixed["k"].astype(cd), cd)
        v = self.v_proj(mixed["v"].astype(cd), cd)
        w = DECAY_SCALE * jax.nn.sigmoid(self.w_lora(mixed["w"], f32))
        a = jax.nn.sigmoid(self.a_lora(mixed["a"], f32))
        g = self.g_lora(mixed["g"].astype(cd), cd)
        kf = k.astype(f32)
        kk = split_heads(kf * self.k_k[...].astype(f32), self.head_dim)
        # F.normalize (x / max(|x|, 1e-12)), with a gradient at x = 0 (padded tokens)
        kk = kk * jax.lax.rsqrt(jnp.maximum(jnp.sum(kk * kk, axis=-1, keepdims=True), 1e-24))
        k = (kf * (1 + (a - 1) * self.k_a[...].astype(f32))).astype(cd)
        if self.layer_idx == 0:
            v_first = v
        else:
            mix = jax.nn.sigmoid(self.v_lora(mixed["v"], f32))
            vf = v.astype(f32)
            v = (vf + mix * (v_first.astype(f32) - vf)).astype(cd)
        r, k, w, a = (split_heads(t, self.head_dim) for t in (r, k, w, a))
        v = split_heads(v, self.head_v_dim)
        op_a, op_b = -kk, kk * a
        if mask is not None:
            k, v, w = neutralise(mask, k), neutralise(mask, v), neutralise(mask, w)
            op_a, op_b = neutralise(mask, op_a), neutralise(mask, op_b)
        o, state = getattr(ops, f"{mode}_rwkv7")(
            r=r, w=w, k=k, v=v, a=op_a, b=op_b, scale=1.0, initial_state=state,
            output_final_state=use_cache, cu_seqlens=cu_seqlens, impl="auto")
        o = self.g_norm(flatten_heads(o))
        bonus = jnp.sum(r.astype(f32) * k.astype(f32) * self.r_k[...].astype(f32), axis=-1,
                        keepdims=True)
        o = ((o.astype(f32) + flatten_heads(bonus * v.astype(f32))) * g.astype(f32)).astype(cd)
        o = self.o_proj(o, cd)
        if mask is not None:
            o = neutralise(mask, o)
        cache = None
        if use_cache:
            cache = make_cache(state, None, next_offset(offset, T, cu_seqlens, mask),
                               shift_state=shift)
        return o, None, cache, v_first
