"""Output and buffer allocation for the Triton op wrappers.

Off the GPU (interpreted kernels) every buffer is NaN-filled first, so a position a kernel
forgets to write can never pass a test; on the GPU it is filled only when POISON_OUTPUTS is True
(the fill costs a full extra write of every output).
"""
from __future__ import annotations

import torch

POISON_OUTPUTS = False


def alloc(shape, dtype, device) -> torch.Tensor:
    if POISON_OUTPUTS or device.type != "cuda":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def alloc_on(device):
    """alloc(shape, dtype) bound to `device` (what the engine's stages take)."""
    return lambda shape, dtype: alloc(shape, dtype, device)


def contiguous(x):
    """x.contiguous(), None stays None."""
    return None if x is None else x.contiguous()
