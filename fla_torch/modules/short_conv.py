"""ShortConvolution: causal depthwise 1-D convolution over time with a decode cache (FLA's name,
constructor and parameters: an `nn.Conv1d` with weight [D, 1, W] and optional bias [D])."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .precision import compute_dtype, no_autocast, resolve_policy, storage_dtype

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
    compute dtype. The products are accumulated in float32 and the result is returned in the
    compute dtype.
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
        if cu_seqlens is not None:
            raise NotImplementedError("ShortConvolution: cu_seqlens (packed sequences) is not "
                                      "supported yet; pass a padded batch [B, T, D]")
        B, T, D = x.shape
        W = self.width
        if D != self.hidden_size:
            raise ValueError(f"ShortConvolution: x has {D} channels ([B, T, D] = "
                             f"{list(x.shape)}); expected D = hidden_size = {self.hidden_size}")
        cd = compute_dtype(x, self.policy)
        x = x.to(cd)
        if cache is None:
            prefix = x.new_zeros(B, W - 1, D)
        else:
            if tuple(cache.shape) != (B, D, W):
                raise ValueError(f"ShortConvolution: cache has shape {list(cache.shape)}; "
                                 f"expected [B, D, W] = [{B}, {D}, {W}]")
            prefix = cache[:, :, 1:].transpose(1, 2).to(cd)
        xp = torch.cat([prefix, x], dim=1)                       # [B, T + W - 1, D]
        with no_autocast(x):
            w = self.weight[:, 0, :].float()                     # [D, W]
            y = xp[:, 0:T].float() * w[:, 0]
            for j in range(1, W):
                y = y + xp[:, j:j + T].float() * w[:, j]
            if self.bias is not None:
                y = y + self.bias.float()
            if self.activation is not None:
                y = F.silu(y)
        final = xp[:, -W:].transpose(1, 2).contiguous() if output_final_state else None
        return y.to(cd), final

    def step(self, x: torch.Tensor, cache: torch.Tensor | None):
        """One decoding step: x [B, 1, D] (or [B, D]) -> (y like x, new cache [B, D, W])."""
        squeeze = x.dim() == 2
        y, final = self.forward(x.unsqueeze(1) if squeeze else x, cache, True)
        return (y.squeeze(1) if squeeze else y), final
