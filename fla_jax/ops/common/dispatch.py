"""impl='auto' | 'reference' | 'chunked' | 'pallas' -> one implementation function.

An op family registers its implementations as {impl: "module:function"}; modules are
imported only when chosen. On a machine without a GPU, 'pallas' runs the kernels with
`interpret=True` (see `pallas_interpret`).
"""
from __future__ import annotations

import contextlib
import importlib

import jax
import numpy as np

from fla_contract import ACTIVATION_DTYPES, KERNEL_DTYPES
from fla_contract.auto_kernel import AUTO_KERNEL

IMPLS = ("auto", "reference", "chunked", "pallas")
KERNEL_IMPL = "pallas"
MOSAIC_IMPL = "mosaic"          # Pallas Mosaic GPU kernels (Hopper only): fla_jax.ops.common.mosaic
KERNEL_IMPLS = (KERNEL_IMPL, MOSAIC_IMPL)
ALLOWED_DTYPES = {"reference": ACTIVATION_DTYPES, "chunked": ACTIVATION_DTYPES,
                  "pallas": KERNEL_DTYPES, "mosaic": KERNEL_DTYPES}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


_COMPILE_FOR_GPU = [False]


def pallas_interpret() -> bool:
    """Pallas kernels run interpreted (on CPU) when the default backend is not a GPU, except
    inside `compiled_for_gpu()`."""
    return not (_COMPILE_FOR_GPU[0] or on_gpu())


@contextlib.contextmanager
def compiled_for_gpu():
    """Build the Pallas calls for the GPU (Triton lowering) even on a CPU-only machine, to
    lower them with `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`: a primitive
    the Triton lowering lacks fails there, where interpret mode would accept it (found on the
    H100: `x[0]` in a kernel lowers to an unimplemented `slice`)."""
    _COMPILE_FOR_GPU[0] = True
    try:
        yield
    finally:
        _COMPILE_FOR_GPU[0] = False


def _auto_dtype_names(op: str) -> tuple:
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    return tuple(names[d] for d in AUTO_KERNEL.get(op, ()))


def resolve_impl(op: str, impl: str, registry: dict, q, auto=None) -> str:
    """Pick the implementation name. 'auto': Pallas kernels on a GPU backend for kernel
    dtypes when the op's kernels are GPU-proven (AUTO_KERNEL), else 'chunked'; an op with its own
    rule passes it as `auto(q) -> name`. Names an op registers beyond IMPLS are accepted."""
    own = tuple(n for n in registry if n not in IMPLS)   # an op with engines of its own
    known = ("auto",) + tuple(registry) if own else IMPLS
    if impl not in known:
        raise ValueError(f"{op}: impl={impl!r}; expected one of {', '.join(known)}")
    if impl == "auto" and auto is not None:
        return auto(q)
    if impl == "auto":
        names = _auto_dtype_names(op)
        if KERNEL_IMPL in registry and on_gpu() and np.dtype(q.dtype).name in names:
            return KERNEL_IMPL
        return "chunked"
    if impl not in registry:
        have = ", ".join(sorted(registry))
        raise ValueError(f"{op}: impl={impl!r} is not available for this op yet; available: "
                         f"{have}")
    return impl


def load_impl(registry: dict, name: str):
    target = registry[name]
    if callable(target):
        return target
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)
