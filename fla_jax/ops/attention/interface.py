"""Public softmax attention (FlashAttention's / FLA's conventions, layout [B, T, H, D]).

    o_t = sum_s softmax_s(scale * q_t . k_s  over the keys t may attend) v_s

Paths: 'reference' (naive, float32 / float64 statistics), 'xla' and 'cudnn'
(jax.nn.dot_product_attention's implementations). No kernel of ours: these engines serve every
dtype and feature (DESIGN.md "Softmax attention"). Works under jax.jit (cu_seqlens may be
traced).
"""
from __future__ import annotations

import numpy as np

from fla_contract import KERNEL_DTYPES, OPS
from fla_contract.attention import check_lengths, check_window

from ..common.dispatch import on_gpu
from ..common.prepare import run_op

IMPLS = {"reference": "fla_jax.ops.attention.reference:attention_reference",
         "xla": "fla_jax.ops.attention.engine:attention_xla",
         "cudnn": "fla_jax.ops.attention.engine:attention_cudnn"}
ALLOWED = {"xla": KERNEL_DTYPES, "cudnn": ("bf16", "fp16")}


def _auto(q, call: dict) -> str:
    """'cudnn' on a GPU where it takes the call (with the XLA path as its fallback: sets
    call['options']['fallback_xla']), 'xla' otherwise; 'reference' for float64."""
    if not hasattr(q, "dtype"):
        return "xla"          # validation names the non-array argument
    if np.dtype(q.dtype) == np.float64:
        return "reference"
    if on_gpu():
        from .engine import cudnn_accepts
        if not cudnn_accepts(q, call["k"], call["causal"], call["window"], call["cu_seqlens"],
                             call["key_mask"], call["v"]):
            call["options"]["fallback_xla"] = True
            return "cudnn"
    return "xla"


def _run(q, k, v, causal, scale, cu_seqlens, window_size, impl, key_mask=None,
         q_offset=None):
    op = OPS["attention"]
    window = check_window(op.name, window_size, causal)
    call = {"k": k, "v": v, "causal": causal, "window": window, "cu_seqlens": cu_seqlens,
            "key_mask": key_mask}
    options = {"causal": causal, "window": window}
    if key_mask is not None:
        options["key_mask"] = key_mask
    if q_offset is not None:
        options["q_offset"] = q_offset
    call["options"] = options
    return run_op(op, IMPLS, impl, q=q, k=k, v=v, scale=scale, cu_seqlens=cu_seqlens,
                  options=options, allowed=ALLOWED, auto=lambda q: _auto(q, call),
                  check=lambda dims: check_lengths(op.name, dims, causal))


def attention(q, k, v, causal: bool = True, scale=None, cu_seqlens=None, window_size=None,
              impl: str = "auto"):
    """Softmax attention with grouped-query heads, packed sequences and a sliding window.

    Args:
        q: [B, T, HQ, K]; k: [B, S, HKV, K]; v: [B, S, HKV, V]; one dtype in {bf16, fp16,
            fp32} (fp64: impl='reference'); HQ % HKV == 0 (query head h reads k/v head
            h // (HQ // HKV)). Query t sits at position t + S - T (S > T: a KV cache).
        causal: query at position p attends keys s <= p.
        scale: float, default K ** -0.5.
        cu_seqlens: [N+1] int offsets of packed sequences (B == 1, S == T): no attention
            across sequences.
        window_size: None; (left, right) as FlashAttention (keys p - left .. p + right, -1 =
            unbounded; right is 0 under causal); or an int w as FLA's Attention layer: the w
            most recent keys including the query's own, = (w - 1, 0).
        impl: 'auto' (cudnn on a GPU where it takes the call, else xla; reference for fp64) |
            'reference' | 'xla' | 'cudnn' (bf16/fp16, T == S, no cu_seqlens).
    Returns:
        o: [B, T, HQ, V] in q's dtype (softmax statistics in float32); gradients in their
        inputs' dtypes.
    """
    return _run(q, k, v, causal, scale, cu_seqlens, window_size, impl)


def attention_with_key_mask(q, k, v, key_mask, causal: bool = True, scale=None,
                            window_size=None, impl: str = "auto", q_offset=None):
    """`attention` for the Attention layer's padding: key_mask bool [B, S], False = padded key
    (never attended except by the query at its own position, whose output the layer
    discards). q_offset: None (query t at position t + S - T) or an int (may be a traced int
    scalar in jax): query t sits at slot q_offset + t -- a preallocated KV cache of S slots
    whose first query is written at slot q_offset (slots after q_offset + t are never
    attended under causal)."""
    if np.dtype(key_mask.dtype) != np.bool_ or tuple(key_mask.shape) != (k.shape[0], k.shape[1]):
        raise ValueError(f"attention: key_mask is {np.dtype(key_mask.dtype).name} "
                         f"{list(key_mask.shape)}; expected bool [B, S] = "
                         f"[{k.shape[0]}, {k.shape[1]}]")
    return _run(q, k, v, causal, scale, None, window_size, impl, key_mask, q_offset)
