"""Public softmax attention (FlashAttention's / FLA's conventions, layout [B, T, H, D]).

    o_t = sum_s softmax_s(scale * q_t . k_s  over the keys t may attend) v_s

Paths: 'reference' (naive, float32 / float64 statistics, fp64 inputs accepted) and 'sdpa'
(torch's scaled_dot_product_attention: flash / memory-efficient / cuDNN / math backends).
No kernel of ours: SDPA serves every dtype and feature (DESIGN.md "Softmax attention").
"""
from __future__ import annotations

import contextlib

import torch

from fla_contract import KERNEL_DTYPES, OPS
from fla_contract.attention import check_lengths, check_window

from ...modules.precision import no_autocast
from ..common.prepare import run_op

IMPLS = {"reference": "fla_torch.ops.attention.reference:attention_reference",
         "sdpa": "fla_torch.ops.attention.engine:attention_sdpa"}
ALLOWED = {"sdpa": KERNEL_DTYPES}


def _auto(q) -> str:
    """'sdpa' for bf16/fp16/fp32, 'reference' for float64."""
    return "reference" if isinstance(q, torch.Tensor) and q.dtype == torch.float64 else "sdpa"


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
        impl: 'auto' (sdpa; reference for fp64) | 'reference' | 'sdpa'.
    Returns:
        o: [B, T, HQ, V] in q's dtype (softmax statistics in float32; float64 for fp64);
        gradients in their inputs' dtypes. Runs with autocast disabled: dtypes are the inputs'.
    """
    op = OPS["attention"]
    window = check_window(op.name, window_size, causal)
    with no_autocast(q) if hasattr(q, "device") else contextlib.nullcontext():
        return run_op(op, IMPLS, impl, q=q, k=k, v=v, scale=scale, cu_seqlens=cu_seqlens,
                      options={"causal": causal, "window": window}, allowed=ALLOWED,
                      auto=_auto, check=lambda dims: check_lengths(op.name, dims, causal))


def attention_with_key_mask(q, k, v, key_mask, causal: bool = True, scale=None, window_size=None,
                            impl: str = "auto", q_offset=None):
    """`attention` for the Attention layer's padding: key_mask bool [B, S], False = padded key
    (never attended except by the query at its own position, whose output the layer
    discards). q_offset: None (query t at position t + S - T) or an int (may be a traced int
    scalar in jax): query t sits at slot q_offset + t -- a preallocated KV cache of S slots
    whose first query is written at slot q_offset (slots after q_offset + t are never
    attended under causal)."""
    op = OPS["attention"]
    window = check_window(op.name, window_size, causal)
    if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (k.shape[0], k.shape[1]):
        raise ValueError(f"attention: key_mask is {key_mask.dtype} {list(key_mask.shape)}; "
                         f"expected bool [B, S] = [{k.shape[0]}, {k.shape[1]}]")
    options = {"causal": causal, "window": window, "key_mask": key_mask}
    if q_offset is not None:
        options["q_offset"] = q_offset
    with no_autocast(q):
        return run_op(op, IMPLS, impl, q=q, k=k, v=v, scale=scale, options=options,
                      allowed=ALLOWED, auto=_auto,
                      check=lambda dims: check_lengths(op.name, dims, causal))

