"""impl='auto' / impl='mosaic' for ops with Pallas Mosaic GPU kernels.

An op with Mosaic kernels registers "mosaic" in its CHUNK_IMPLS and passes its public impl
through `mosaic_or(...)` before run_op: 'auto' becomes 'mosaic' only on a Hopper GPU, for an
op/dtype listed in fla_contract.auto_kernel.AUTO_MOSAIC (GPU-proven), and when the op's
`mosaic_unsupported_reason` returns None for the call; otherwise 'auto' goes on as before
(Pallas Triton-lowering kernels on a GPU). With impl='mosaic' the kernel wrapper raises the
reason as a named error (`check_mosaic`).
"""
from __future__ import annotations

import numpy as np

from fla_contract.auto_kernel import AUTO_MOSAIC

from .lowering import mosaic_error, on_hopper, require_hopper

_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def mosaic_proven(op: str, dtype) -> bool:
    """op's Mosaic kernels passed a GPU parity run in this q dtype (AUTO_MOSAIC)."""
    return np.dtype(dtype).name in tuple(_DTYPE_NAMES[d] for d in AUTO_MOSAIC.get(op, ()))


def mosaic_or(op: str, impl: str, q, reason) -> str:
    """impl, with 'auto' turned into 'mosaic' where the Mosaic kernels are proven and take
    the call. reason: () -> str | None (None: the Mosaic kernels take this call); called only
    when the rest holds."""
    if impl != "auto" or q is None or not mosaic_proven(op, q.dtype) or not on_hopper():
        return impl
    return "mosaic" if reason() is None else impl


def check_mosaic(op: str, reason) -> None:
    """What impl='mosaic' raises: a named ValueError off a Hopper GPU, or with the reason
    (str | None) the kernels cannot take the call."""
    require_hopper(op)
    if reason is not None:
        raise mosaic_error(op, reason)
