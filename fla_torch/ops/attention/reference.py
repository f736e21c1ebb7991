"""Naive softmax attention: scores, softmax and the value sum in float32 (float64 for float64
inputs), the [B, HQ, T, S] score matrix materialised. The oracle of the parity tests."""
from __future__ import annotations

import torch

from ... import dtypes
from .mask import allowed_mask


def attention_reference(q, k, v, *, scale: float, causal: bool, window, cu_seqlens=None,
                        key_mask=None, q_offset=None):
    """q: [B, T, HQ, K]; k: [B, S, HKV, K]; v: [B, S, HKV, V] -> o [B, T, HQ, V] in q's dtype."""
    B, T, HQ, _ = q.shape
    S, HKV = k.shape[1], k.shape[2]
    cd = dtypes.gate_dtype(q.dtype)
    qf = q.to(cd)
    kf = k.to(cd).repeat_interleave(HQ // HKV, dim=2)
    vf = v.to(cd).repeat_interleave(HQ // HKV, dim=2)
    s = torch.einsum("bthd,bshd->bhts", qf, kf) * scale
    if causal or window is not None or cu_seqlens is not None or key_mask is not None:
        ok = allowed_mask(T, S, causal, window, cu_seqlens, key_mask, q.device, q_offset)
        s = s.masked_fill(~ok[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhts,bshd->bthd", p, vf).to(q.dtype)
