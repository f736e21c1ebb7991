"""Bring q/k/v and gates to the compute dtype shared by the reference and chunked ops.

Compute dtype: float32, or float64 when q is float64 (needs jax_enable_x64).
Grouped value heads: value head hv reads q/k head hv // (HV // H).
"""
from __future__ import annotations

import jax.numpy as jnp

from ... import dtypes

L2NORM_EPS = 1e-6


def compute_dtype(q):
    """float32, or float64 for float64 q."""
    return dtypes.gate_dtype(q.dtype)


def l2_normalize(x):
    """x / sqrt(sum(x^2, last axis) + 1e-6); x: [..., K] already in the compute dtype."""
    return x * jnp.reciprocal(jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS))


def expand_heads(x, num_value_heads: int):
    """[B, T, H, D] -> [B, T, HV, D]: value head hv takes head hv // (HV // H)."""
    H = x.shape[2]
    if H == num_value_heads:
        return x
    return jnp.repeat(x, num_value_heads // H, axis=2)


def prepare_qkv(q, k, v, use_qk_l2norm_in_kernel: bool = False):
    """Cast q, k, v to the compute dtype, optionally L2-normalise q and k, expand q/k heads
    to v's head count. Returns (q, k, v) with q, k: [B, T, HV, K], v: [B, T, HV, V]."""
    cd = compute_dtype(q)
    q, k, v = q.astype(cd), k.astype(cd), v.astype(cd)
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    HV = v.shape[2]
    return expand_heads(q, HV), expand_heads(k, HV), v


def einsum(spec: str, a, b):
    """jnp.einsum at the library's fp32 matmul precision (IEEE unless `allow_tf32()`),
    accumulating in a's dtype (the compute dtype)."""
    return jnp.einsum(spec, a, b, precision=dtypes.matmul_precision(),
                      preferred_element_type=a.dtype)
