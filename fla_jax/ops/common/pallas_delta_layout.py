"""Layout helpers shared by the Pallas delta-rule kernels (recurrent and chunked).

The kernels read activations in place as token-major slabs: [B, T, H, D] is viewed as
[B*T, H, D] (a free reshape) and every sequence n covers tokens cu[n] .. cu[n+1] of it;
without cu_seqlens the sequences are the B rows (cu = arange(B + 1) * T).
Head sizes that are not powers of two are zero-padded (Triton tiles are powers of two);
zero columns of q/k/v do not change the recurrence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ... import dtypes

L2NORM_EPS = 1e-6


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# How 'ieee' fp32 dots run on the GPU: "3xtf32" (three tf32 tensor-core passes, fp32-level
# accuracy) or "fma" (Triton's IEEE path on CUDA cores, exact but slow for 64-wide tiles).
FP32_GPU_DOT = ["3xtf32"]


def dot_precision(interpret: bool = True):
    """Precision for fp32-operand jnp.dot inside kernels: fp32 accuracy unless allow_tf32() is
    active (in the Triton lowering, Precision.DEFAULT on fp32 operands means plain tf32)."""
    if dtypes.fp32_matmul_precision() != "ieee":
        return lax.Precision.DEFAULT
    if interpret or FP32_GPU_DOT[0] == "fma":
        return lax.Precision.HIGHEST
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def kdot(a, b, prec32):
    """a @ b accumulated in fp32; fp32 operands use prec32 (see dot_precision), half-precision
    operands the native tensor-core path."""
    prec = prec32 if a.dtype == jnp.float32 else lax.Precision.HIGHEST
    return jnp.dot(a, b, precision=prec, preferred_element_type=jnp.float32)


def sequence_bounds(B: int, T: int, cu_seqlens):
    """int32 [N+1] token offsets into the flattened [B*T] axis."""
    if cu_seqlens is None:
        return jnp.arange(B + 1, dtype=jnp.int32) * T
    return cu_seqlens.astype(jnp.int32)


def pad_last(x, size: int):
    """Zero-pad the last axis of x to `size` (no-op when already that size)."""
    if x is None or x.shape[-1] == size:
        return x
    pad = [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])]
    return jnp.pad(x, pad)


def l2norm_fwd(x):
    """x / sqrt(sum(x^2) + eps) over the last axis, in fp32 (usable inside kernels)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def l2norm_bwd(x, dy):
    """Gradient of l2norm_fwd at x for the upstream gradient dy (both [..., D]), fp32."""
    x = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)
    y = x * r
    return (dy - y * jnp.sum(y * dy, axis=-1, keepdims=True)) * r


def group_sum(x, H: int):
    """[..., HV, D] per-value-head partials -> [..., H, D]: value head hv belongs to q/k
    head hv // (HV // H)."""
    HV = x.shape[-2]
    if HV == H:
        return x
    return x.reshape(*x.shape[:-2], H, HV // H, x.shape[-1]).sum(axis=-2)


def triton_params(num_warps: int, num_stages: int = 1):
    """Compiler params selecting the Triton lowering (None when interpreting)."""
    from jax.experimental.pallas import triton as plt
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
