"""Linear-attention layers and softmax `Attention` for Flax NNX (FLA's class names,
constructor arguments and parameter names; parameters named and shaped exactly as in
fla_torch.layers, so fla_jax.interop maps a torch state_dict onto them one to one).

Every layer: __call__(hidden_states [B, T, hidden], attention_mask=None, past_key_values=None,
use_cache=False) -> (o [B, T, hidden], None, cache dict or None) (RWKV7Attention also takes
and returns v_first, FLA's 4-tuple); the cache dict is described in
fla_jax/layers/cache.py (Attention's KV cache: layers/kv_cache.py) and is the same in
fla_torch.layers. Constructors take FLA's arguments plus Flax's `dtype` (compute; None = the
input's dtype), `param_dtype` (storage) and `rngs`.
attention_mask: None or [B, T] of 0/1 (1 = real token; left, right or inner padding);
padded tokens change no state and their outputs are 0 -- see layers/padding.py.
"""
from .attn import Attention
from .delta_net import DeltaNet
from .gated_deltanet import GatedDeltaNet
from .gla import GatedLinearAttention
from .gsa import GatedSlotAttention
from .kda import KimiDeltaAttention
from .linear_attention import LinearAttention
from .multiscale_retention import MultiScaleRetention
from .rwkv7 import RWKV7Attention

__all__ = ["LinearAttention", "MultiScaleRetention", "GatedLinearAttention", "DeltaNet",
           "GatedDeltaNet", "GatedSlotAttention", "KimiDeltaAttention", "RWKV7Attention",
           "Attention"]
