"""Lower each of this library's Mosaic GPU kernels once per process.

JAX lowers a Pallas kernel anew in every program that holds it: a training step lowers the
forward's kernels again (the delta family at B1 T32768: T0, the map pass and the piece scan,
~1.2 s of Python on the H200 host), any second jit around an op lowers all of them again. The
result is the same module each time (kernel_cache.py keeps it free of per-lowering stamps).

Here the Mosaic module of a kernel of this library (registered by `tiles.build`) is kept, as
MLIR bytecode, under a key that holds everything the lowering reads: the kernel's jaxpr as text
(every equation and its parameters; the jaxpr itself is kept alive, so object addresses in it
stay unique), its name, and the other arguments of the lowering (grid or mesh, operand shapes,
compiler parameters) by repr. A second lowering with the same key parses the bytecode into the
new program's MLIR context instead of lowering: the same module, hence the same kernel hash (a
compile-cache hit in jaxlib). Where the key could hide a difference (numpy's '...' in the
jaxpr text; `ref[...]`, a whole ref, is not one), or Mosaic dumps are asked for
(MOSAIC_GPU_DUMP_*), it lowers as before. The cache keeps the MAX_ENTRIES kernels used last (a training step of one op has at most
nine; a process that lowers many shapes, a test suite, stays bounded). `LOWERING_CACHE = False`
turns it off.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import io
import os

LOWERING_CACHE = True
MAX_ENTRIES = 64
STATS = {"hits": 0, "misses": 0, "skipped": 0}

_CACHE: collections.OrderedDict = collections.OrderedDict()
_NAMES = ("lower_unpipelined_jaxpr_to_module",     # jax 0.11 (mpmd_map kernels)
          "lower_pipelined_jaxpr_to_module")       # jax 0.10 (pallas_call kernels)


def _dumping() -> bool:
    return any(k.startswith("MOSAIC_GPU_DUMP") and os.environ[k] not in ("", "0")
               for k in os.environ)


def _jaxpr_of(args):
    """The kernel's jaxpr among a lowering call's arguments (None if there is none)."""
    from jax._src import core as jax_core
    return next((a for a in args if isinstance(a, jax_core.Jaxpr)), None)


def _rest_key(args, kwargs, jaxpr):
    """The lowering call's other arguments by repr (the traceback, locations only, left out)."""
    rest = [repr(a) for a in args if a is not jaxpr]
    rest += [f"{k}={v!r}" for k, v in sorted(kwargs.items()) if k != "outer_traceback"]
    return tuple(rest)


def kernel_name(jaxpr) -> str | None:
    from jax._src.interpreters import mlir
    info = getattr(jaxpr, "debug_info", None)
    name = getattr(info, "func_name", None)
    return None if name is None else mlir.sanitize_name(name)


def _wrap(fname: str, lower):
    from . import kernel_cache

    def lower_once(*args, **kwargs):
        if not LOWERING_CACHE:
            return lower(*args, **kwargs)
        jaxpr = _jaxpr_of(args)
        name = None if jaxpr is None else kernel_name(jaxpr)
        if not kernel_cache.is_ours(name) or _dumping():
            return lower(*args, **kwargs)
        text = str(jaxpr)
        if "..." in text.replace("[...]", ""):      # '[...]' indexes a whole ref; other
            # dots: numpy elided an array, and the text may not tell two kernels apart
            STATS["skipped"] += 1
            return lower(*args, **kwargs)
        key = (fname, name, text, _rest_key(args, kwargs, jaxpr))
        hit = _CACHE.get(key)
        if hit is not None:
            STATS["hits"] += 1
            _CACHE.move_to_end(key)
            return _restore(*hit[:2])
        result = lower(*args, **kwargs)
        STATS["misses"] += 1
        buf = io.BytesIO()
        result.module.operation.write_bytecode(buf)
        # the first lowering's other fields (grid, shapes) without its module (whose context
        # would stay alive with it); the jaxpr kept alive (see above)
        _CACHE[key] = (dataclasses.replace(result, module=None), buf.getvalue(), jaxpr)
        while len(_CACHE) > MAX_ENTRIES:
            _CACHE.popitem(last=False)
        return result
    lower_once.__wrapped__ = lower
    return lower_once


def _restore(result, bytecode):
    """A copy of `result` whose module is parsed from `bytecode` into the current context."""
    from jax._src.lib.mlir import ir
    return dataclasses.replace(result, module=ir.Module.parse(bytecode))


@functools.cache
def install() -> None:
    """Wrap Pallas' Mosaic GPU lowering (once): this library's kernels (kernel_cache.is_ours)
    are lowered once per process and key."""
    try:
        from jax._src.pallas.mosaic_gpu import lowering
    except ImportError:
        return
    for fname in _NAMES:
        lower = getattr(lowering, fname, None)
        if lower is not None:
            setattr(lowering, fname, _wrap(fname, lower))
