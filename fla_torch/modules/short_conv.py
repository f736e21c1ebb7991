"""ShortConvolution: causal depthwise 1-D convolution over time with a decode cache (FLA's name,
constructor and parameters: an `nn.Conv1d` with weight [D, 1, W] and optional bias [D])."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .precision import compute_dtype, no_autocast, resolve_policy, storage_dtype
from .varlen import token_sequence

_ACTIVATIONS = (None, "silu", "swish")


class ShortConvolution(nn.Conv1d):
    """y[t] = act(bias + sum_j weight[:, 0, j] * x[t - (W - 1) + j]), x[<0] = 0 (or the cache).

    Args:
        hidden_size: D, channels (depthwise: one filter per channel).
        kernel_size: W, the filter width.
        bias: learn a bias [D].
        activation: None, 'silu' or 'swish'.
        device, dtype: parameter placement and storage dtype (torch convention).
        policy: optional compute policy (`fla_torch.DtypePolicy` or string).

    Cache (`conv_state`): [B, D, W], the last W inputs, newest last (FLA's layout), in the
    compute dtype. Packed sequences: x [1, T, D] with cu_seqlens [N+1] and a cache [N, D, W].
    The products are accumulated in float32 and the result is returned in the compute dtype.
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False,
                 activation: str | None = "silu", device=None, dtype=None, policy=None,
                 **kwargs):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"ShortConvolution: activation={activation!r}; expected one of "
                             f"None, 'silu', 'swish'")
        policy = resolve_policy(policy)
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias,
                         padding=kernel_size - 1, device=device,
                         dtype=storage_dtype(dtype, policy))
        self.hidden_size = hidden_size
        self.activation = activation
        self.policy = policy

    @property
    def width(self) -> int:
        return self.kernel_size[0]

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None,
                output_final_state: bool = False, cu_seqlens=None, **kwargs):
        """x: [B, T, D]; cache: None or [B, D, W]. Returns (y [B, T, D] in the compute dtype,
        final cache [B, D, W] or None unless output_final_state)."""
        B, T, D = x.shape
        W = self.width
        if D != self.hidden_size:
            raise ValueError(f"ShortConvolution: x has {D} channels ([B, T, D] = "
                             f"{list(x.shape)}); expected D = hidden_size = {self.hidden_size}")
        cd = compute_dtype(x, self.policy)
        x = x.to(cd)
        if cu_seqlens is not None:
            return self._forward_varlen(x, cache, output_final_state, cu_seqlens, cd)
        if cache is None:
            prefix = x.new_zeros(B, W - 1, D)
        else:
            if tuple(cache.shape) != (B, D, W):
                raise ValueError(f"ShortConvolution: cache has shape {list(cache.shape)}; "
                                 f"expected [B, D, W] = [{B}, {D}, {W}]")
            prefix = cache[:, :, 1:].transpose(1, 2).to(cd)
        xp = torch.cat([prefix, x], dim=1)                       # [B, T + W - 1, D]
        y = self._combine([xp[:, j:j + T] for j in range(W)], cd)
        final = xp[:, -W:].transpose(1, 2).contiguous() if output_final_state else None
        return y, final

    def _combine(self, taps, cd):
        """taps[j]: [..., D] input seen by filter tap j -> act(sum_j w[:, j] taps[j] + b)."""
        with no_autocast(taps[0]):
            w = self.weight[:, 0, :].float()
            y = taps[0].float() * w[:, 0]
            for j in range(1, len(taps)):
                y = y + taps[j].float() * w[:, j]
            if self.bias is not None:
                y = y + self.bias.float()
            if self.activation is not None:
                y = F.silu(y)
        return y.to(cd)

    def _forward_varlen(self, x, cache, output_final_state, cu_seqlens, cd):
        """Packed sequences: x [1, T, D], cu_seqlens [N+1]; cache None or [N, D, W] (one row
        per sequence). No tap reads across a sequence boundary; before its start a sequence
        reads its cache row (or zeros)."""
        B, T, D = x.shape
        W = self.width
        N = cu_seqlens.numel() - 1
        if B != 1:
            raise ValueError(f"ShortConvolution: cu_seqlens given with batch size B={B}; "
                             f"expected B == 1 (sequences packed along T)")
        if cache is not None and tuple(cache.shape) != (N, D, W):
            raise ValueError(f"ShortConvolution: cache has shape {list(cache.shape)}; expected "
                             f"[N, D, W] = [{N}, {D}, {W}] (one row per sequence)")
        seq, start = token_sequence(cu_seqlens, T)
        t = torch.arange(T, device=x.device)

        def read(pos, rel, rows):
            """x[0, pos] where rel = pos - start >= 0, else cache[rows, :, W + rel] (or 0)."""
            inside = x[0, pos.clamp(min=0, max=T - 1)]
            if cache is None:
                before = torch.zeros_like(inside)
            else:
                before = cache[rows, :, (W + rel).clamp(min=0, max=W - 1)].to(cd)
            return torch.where((rel >= 0)[:, None], inside, before)

        taps = [read(t - (W - 1 - j), t - (W - 1 - j) - start, seq)[None] for j in range(W)]
        y = self._combine(taps, cd)
        final = None
        if output_final_state:
            cu = cu_seqlens.to(torch.long)
            rows = torch.arange(N, device=x.device)
            cols = [read(cu[1:] - W + i, cu[1:] - W + i - cu[:-1], rows) for i in range(W)]
            final = torch.stack(cols, dim=-1)                       # [N, D, W]
        return y, final

    def step(self, x: torch.Tensor, cache: torch.Tensor | None):
        """One decoding step: x [B, 1, D] (or [B, D]) -> (y like x, new cache [B, D, W])."""
        squeeze = x.dim() == 2
        y, final = self.forward(x.unsqueeze(1) if squeeze else x, cache, True)
        return (y.squeeze(1) if squeeze else y), final
