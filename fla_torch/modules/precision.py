"""How fla_torch modules choose and apply their compute dtype.

The rules (the same as fla_jax.modules.precision, written for torch's conventions):
- Parameters are stored in whatever dtype they were built with (`dtype=` at construction)
  or moved to (`module.to(...)`).
- The compute dtype of a call is, first match wins:
  the module's `policy.compute_dtype` (a `fla_torch.DtypePolicy` or policy string),
  the autocast dtype when `torch.autocast` is active for the input's device,
  otherwise the dtype of the input activation.
- Parameters are cast to the compute dtype before they touch activations (an fp32 parameter
  never promotes an fp16 activation; parity_tests/test_modules_dtype.py).
- Gates, log-decays and beta are computed in float32 in an autocast-free region.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..dtypes import DtypePolicy


def resolve_policy(policy) -> DtypePolicy | None:
    """None, a `DtypePolicy` or a policy string ('bf16', 'params=fp32,compute=bf16') ->
    a `DtypePolicy` or None."""
    if policy is None:
        return None
    if isinstance(policy, DtypePolicy):
        return policy
    if isinstance(policy, str):
        try:
            return DtypePolicy.parse(policy)
        except ValueError as e:
            raise ValueError(f"policy={policy!r}: {e}") from None
    raise TypeError(f"policy: got {type(policy).__name__} {policy!r}; expected None, a "
                    f"fla_torch.DtypePolicy or a policy string such as 'bf16' or "
                    f"'params=fp32,compute=bf16,output=fp32'")


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The active autocast dtype for x's device, or None when autocast is off there."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def compute_dtype(x: torch.Tensor, policy: DtypePolicy | None) -> torch.dtype:
    """policy.compute_dtype, else the autocast dtype, else x.dtype."""
    if policy is not None:
        return policy.compute_dtype
    auto = autocast_dtype(x)
    return auto if auto is not None else x.dtype


def output_dtype(compute: torch.dtype, policy: DtypePolicy | None) -> torch.dtype:
    """policy.output_dtype, else the compute dtype."""
    return policy.output_dtype if policy is not None else compute


@contextlib.contextmanager
def no_autocast(x: torch.Tensor):
    """Disable autocast for x's device type (a region where dtypes are explicit)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        yield


def linear(x: torch.Tensor, layer: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor:
    """`layer(x)` computed in `dtype`: x, weight and bias are cast to `dtype` first.

    x: [..., in]; returns [..., out] in `dtype`. Runs with autocast disabled so `dtype` (which
    already is the autocast dtype when autocast is on and no policy is set) is what runs.
    """
    with no_autocast(x):
        bias = None if layer.bias is None else layer.bias.to(dtype)
        return F.linear(x.to(dtype), layer.weight.to(dtype), bias)


def linear_fp32(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """`layer(x)` in float32 (for gate / decay / beta projections)."""
    return linear(x, layer, torch.float32)


def storage_dtype(dtype, policy: DtypePolicy | None):
    """The parameter dtype at construction: `dtype=` when given, else policy.param_dtype when
    a policy is given, else None (torch's default dtype)."""
    if dtype is not None or policy is None:
        return dtype
    return policy.param_dtype
