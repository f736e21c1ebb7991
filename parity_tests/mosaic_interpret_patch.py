"""Test-harness speed-up for JAX's Mosaic GPU interpret mode (CPU runs only; CI time).

The interpreter runs a kernel's warpgroups as threads (jax._src.pallas.mosaic.interpret.
thread_map): for every CTA, each thread traces, lowers and compiles the same warpgroup jaxpr
again (`_run_jaxpr`: `jax.jit(...).trace(...).lower().compile()`, then calls it), which the
XLA CPU compiler does anew each time (about 40% of an interpreted delta-rule test's time).
`apply()` replaces `_run_jaxpr` with one that compiles each (jaxpr, argument shapes and dtypes)
once, exactly as the original does, and calls that executable: the same program on the same
arguments, so the kernels compute what they did, bit for bit
(parity_tests/test_mosaic_lowering.py checks it against the original).

conftest.py applies it when the suite runs on CPU (PARITY_DEVICE != cuda); `apply()` is
idempotent and returns whether the interpreter is (now) patched.
"""
from __future__ import annotations

import threading
import weakref

_MARK = "_fla_compile_once"


def _signature(tree) -> tuple:
    import jax
    import numpy as np
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef,) + tuple((np.shape(x), np.dtype(getattr(x, "dtype", None)
                                                     or np.asarray(x).dtype).str,
                               bool(getattr(x, "weak_type", False))) for x in leaves)


def apply() -> bool:
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        return False
    original = thread_map._run_jaxpr
    if getattr(original, _MARK, False):
        return True
    import jax
    import jax.core as jax_core

    lock = threading.Lock()
    compiled = weakref.WeakKeyDictionary()     # jaxpr -> {signature: [lock, executable]}

    def _run(jaxpr, consts, *args):            # what the original jits, unchanged
        jax_core.eval_jaxpr(jaxpr, consts, *args)

    def run_jaxpr(jaxpr, consts, *args):
        key = _signature((consts, args))
        with lock:
            entry = compiled.setdefault(jaxpr, {}).setdefault(key, [threading.Lock(), None])
        with entry[0]:
            if entry[1] is None:
                entry[1] = jax.jit(_run, static_argnums=(0,)).trace(
                    jaxpr, consts, *args).lower().compile()
        entry[1](consts, *args)

    setattr(run_jaxpr, _MARK, True)
    run_jaxpr.__wrapped__ = original
    thread_map._run_jaxpr = run_jaxpr
    return True
