"""jax.nn.dot_product_attention as the attention engine: implementation 'xla' (every backend,
every dtype; logits and softmax in float32) or 'cudnn' (NVIDIA GPUs, bf16/fp16, fused).

Plain causal or full attention with T == S goes in as is_causal (cuDNN's causal mask, a
causal sliding window as cuDNN's sliding_window_length); a window, packed sequences
(cu_seqlens), padding or T != S go to XLA as a boolean mask (mask.py). fp32 logits run at
Precision.HIGHEST unless fla_jax.dtypes.allow_tf32() is active. The engine takes one head
size for q/k and v: with K != V the smaller side is zero-padded (zeros in q and k add nothing
to a score; zero value columns are sliced off). float16 off a GPU runs the float32 reference
formulation: jax's XLA path asks dot_general for the F16_F16_F32 algorithm, which XLA:CPU
rejects once compiled (jit).
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from ... import dtypes
from ..common.dispatch import on_gpu
from .mask import allowed_mask, needs_mask
from .reference import attention_reference


def cudnn_accepts(q, k, causal: bool, window, cu_seqlens=None, key_mask=None, v=None) -> str:
    """'' when the cuDNN path takes the call, else the reason it does not."""
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(q.dtype).name} (cuDNN takes bfloat16 and float16)"
    if cu_seqlens is not None:
        return "cu_seqlens (packed sequences)"
    if key_mask is not None:
        return "a padding mask"
    if q.shape[1] != k.shape[1]:
        return f"T={q.shape[1]} != S={k.shape[1]}"
    if window is not None and not causal and window[1] != 0:
        return f"window_size={window} (a right window without causal)"
    D = max(q.shape[-1], v.shape[-1]) if v is not None else q.shape[-1]
    if D > 128 or D % 8:
        return f"head size {D} (cuDNN takes multiples of 8 up to 128)"
    return ""


def _same_head_size(q, k, v):
    K, V = q.shape[-1], v.shape[-1]
    pad = [(0, 0)] * 3
    if V < K:
        v = jnp.pad(v, pad + [(0, K - V)])
    elif K < V:
        q, k = jnp.pad(q, pad + [(0, V - K)]), jnp.pad(k, pad + [(0, V - K)])
    return q, k, v, V


def _precision(q):
    if jnp.dtype(q.dtype) == jnp.dtype(jnp.float32) and dtypes.fp32_matmul_precision() == "ieee":
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def attention_xla(q, k, v, *, scale: float, causal: bool, window, cu_seqlens=None,
                  key_mask=None, q_offset=None):
    """q: [B, T, HQ, K]; k: [B, S, HKV, K]; v: [B, S, HKV, V] -> o [B, T, HQ, V] in q's dtype."""
    T, S = q.shape[1], k.shape[1]
    if jnp.dtype(q.dtype) == jnp.dtype(jnp.float16) and not on_gpu():
        return attention_reference(q, k, v, scale=scale, causal=causal, window=window,
                                   cu_seqlens=cu_seqlens, key_mask=key_mask,
                                   q_offset=q_offset)
    q, k, v, V = _same_head_size(q, k, v)
    with _precision(q):
        if not needs_mask(T, S, causal, window, cu_seqlens, key_mask):
            o = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                             implementation="xla")
        else:
            ok = allowed_mask(T, S, causal, window, cu_seqlens, key_mask, q_offset)[:, None]
            o = jax.nn.dot_product_attention(q, k, v, mask=ok, scale=scale,
                                             implementation="xla")
    return o[..., :V].astype(q.dtype)


def attention_cudnn(q, k, v, *, scale: float, causal: bool, window, cu_seqlens=None,
                    key_mask=None, fallback_xla: bool = False, q_offset=None):
    """The cuDNN fused kernel; raises ValueError for a call it does not take (cudnn_accepts).
    fallback_xla (impl='auto' only): a call that jax's cuDNN wrapper refuses while tracing
    (its own shape / version checks, beyond cudnn_accepts) runs the XLA path instead."""
    why = cudnn_accepts(q, k, causal, window, cu_seqlens, key_mask, v)
    if why:
        raise ValueError(f"attention(impl='cudnn'): cuDNN does not take {why}; use "
                         f"impl='auto' or impl='xla'")
    if fallback_xla:
        try:
            return attention_cudnn(q, k, v, scale=scale, causal=causal, window=window)
        except (ValueError, NotImplementedError, RuntimeError):
            return attention_xla(q, k, v, scale=scale, causal=causal, window=window)
    q, k, v, V = _same_head_size(q, k, v)
    o = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                     local_window_size=window, implementation="cudnn")
    return o[..., :V].astype(q.dtype)
