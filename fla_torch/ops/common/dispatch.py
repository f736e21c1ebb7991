"""impl='auto' | 'reference' | 'chunked' | 'triton' -> one implementation function.

An op family registers its implementations as {impl: "module:function"}; modules are
imported only when chosen, so fla_torch imports without triton installed.
"""
from __future__ import annotations

import importlib
import os

import torch

from fla_contract import ACTIVATION_DTYPES, KERNEL_DTYPES
from fla_contract.auto_kernel import AUTO_KERNEL

IMPLS = ("auto", "reference", "chunked", "triton")
KERNEL_IMPL = "triton"
ALLOWED_DTYPES = {"reference": ACTIVATION_DTYPES, "chunked": ACTIVATION_DTYPES,
                  "triton": KERNEL_DTYPES}


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _auto_dtype_names(op: str) -> tuple:
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    return tuple(names[d] for d in AUTO_KERNEL.get(op, ()))


def resolve_impl(op: str, impl: str, registry: dict, q: torch.Tensor, auto=None) -> str:
    """Pick the implementation name. 'auto': Triton kernels for CUDA tensors of a kernel
    dtype when the op's kernels are GPU-proven (AUTO_KERNEL), else 'chunked'; an op with its own
    rule passes it as `auto(q) -> name`. Names an op registers beyond IMPLS are accepted."""
    own = tuple(n for n in registry if n not in IMPLS)   # an op with engines of its own
    known = ("auto",) + tuple(registry) if own else IMPLS
    if impl not in known:
        raise ValueError(f"{op}: impl={impl!r}; expected one of {', '.join(known)}")
    if impl == "auto" and auto is not None:
        return auto(q)
    if impl == "auto":
        if (KERNEL_IMPL in registry and isinstance(q, torch.Tensor) and q.is_cuda
                and str(q.dtype).replace("torch.", "") in _auto_dtype_names(op)):
            return KERNEL_IMPL
        return "chunked"
    if impl not in registry:
        have = ", ".join(sorted(registry))
        raise ValueError(f"{op}: impl={impl!r} is not available for this op yet; available: "
                         f"{have}")
    if impl == KERNEL_IMPL and isinstance(q, torch.Tensor) and not q.is_cuda \
            and not triton_interpret():
        raise ValueError(f"{op}: impl='triton' got tensors on {q.device}; expected CUDA tensors, "
                         f"or set TRITON_INTERPRET=1 before importing triton to run the kernels "
                         f"on CPU")
    return impl


def load_impl(registry: dict, name: str):
    target = registry[name]
    if callable(target):
        return target
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)
