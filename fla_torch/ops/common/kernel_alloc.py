"""Output and buffer allocation for the Triton op wrappers.

Off the GPU (interpreted kernels) every buffer is NaN-filled first, so a position a kernel
forgets to write can never pass a test. On the GPU a buffer is torch.empty (a fill would cost a
full extra write of every output); the test harness NaN-fills it there instead
(parity_tests/torch_runner.poisoned_allocations).
"""
from __future__ import annotations

import torch

def alloc(shape, dtype, device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def alloc_on(device):
    """alloc(shape, dtype) bound to `device` (what the engine's stages take)."""
    return lambda shape, dtype: alloc(shape, dtype, device)


def contiguous(x):
    """x.contiguous(), None stays None."""
    return None if x is None else x.contiguous()
