"""torch.nn.functional.scaled_dot_product_attention as the attention engine.

SDPA picks its backend per call: flash (fp16/bf16 on CUDA, no mask), memory-efficient
(fp32/fp16/bf16, masks), cuDNN, or math; all keep the softmax statistics in float32. Plain
causal or full attention goes in as is_causal; a window, packed sequences (cu_seqlens),
padding or T != S go in as a boolean mask (mask.py). Grouped k/v heads go in unrepeated
(enable_gqa) only where flash takes the call -- enable_gqa is a flash-only feature, elsewhere
it drops SDPA to its math backend -- and are repeated to HQ heads otherwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .mask import allowed_mask, needs_mask


def _flash_eligible(q, v) -> bool:
    """CUDA, fp16/bf16, one head size <= 256: the calls SDPA's flash backend takes."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] == v.shape[-1] <= 256)


def attention_sdpa(q, k, v, *, scale: float, causal: bool, window, cu_seqlens=None,
                   key_mask=None, q_offset=None):
    """q: [B, T, HQ, K]; k: [B, S, HKV, K]; v: [B, S, HKV, V] -> o [B, T, HQ, V] in q's dtype."""
    T, HQ = q.shape[1], q.shape[2]
    S, HKV = k.shape[1], k.shape[2]
    G = HQ // HKV
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if not needs_mask(T, S, causal, window, cu_seqlens, key_mask):
        kw = {}
        if G > 1 and _flash_eligible(q, v):
            kw = {"enable_gqa": True}
        elif G > 1:
            kt, vt = kt.repeat_interleave(G, dim=1), vt.repeat_interleave(G, dim=1)
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, **kw)
    else:
        ok = allowed_mask(T, S, causal, window, cu_seqlens, key_mask, q.device, q_offset)[:, None]
        if G > 1:
            kt, vt = kt.repeat_interleave(G, dim=1), vt.repeat_interleave(G, dim=1)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=ok, scale=scale)
    return o.transpose(1, 2).contiguous()
