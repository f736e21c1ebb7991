"""Compile this library's Mosaic GPU kernels while the rest of the program is still lowering.

A jitted program's first call lowers it (Python: each Pallas Mosaic GPU kernel is traced to
MLIR, 0.3-0.8 s a kernel) and then compiles it (XLA compiles each Mosaic kernel in turn,
0.6-3.5 s a kernel, under one process-wide lock). The two phases run one after the other: a
training step with nine Mosaic kernels spent ~6 s lowering, then ~13 s compiling (RESULTS.md
run 29: the delta rule at B1 T32768).

Here, right after one of this library's kernels is lowered (its custom call emitted), a
background thread compiles a one-kernel program holding the very same custom call: every
attribute copied, hence the same kernel hash, and jaxlib caches compiled Mosaic kernels by that
hash for the process. The main thread goes on lowering the next kernel; when XLA compiles the
real program, its kernels are found compiled (or it waits on jaxlib's cache lock for the one in
flight). Nothing about the program changes: the same kernels, compiled once, only earlier.

Only on a GPU backend, only for a CUDA lowering that will be compiled here (not while
`export_for_cuda` lowers without a GPU), only for kernels built by `tiles.build`; each kernel
hash once per process. A failed compile ahead is recorded (`FAILED`) and otherwise ignored: the
real compile raises its own error. `COMPILE_AHEAD = False` turns it off.
"""
from __future__ import annotations

import atexit
import functools
import queue
import threading

COMPILE_AHEAD = True
FAILED: list[str] = []        # "<kernel>: <error>" of compiles ahead that raised

_SEEN: set = set()            # the custom calls queued in this process (their attributes)
_QUEUE: queue.Queue = queue.Queue()
_WORKER: list = [None]
_STOPPING = [False]


class Job:
    """One kernel's custom call in a form any MLIR context parses back: the operand and result
    avals, the result types and every attribute of the original `stablehlo.custom_call`, as
    text."""

    def __init__(self, name, avals_in, avals_out, result_types, attributes):
        self.name = name
        self.avals_in = tuple(avals_in)
        self.avals_out = tuple(avals_out)
        self.result_types = tuple(result_types)
        self.attributes = tuple(attributes)


def capture(name, ctx, results) -> Job | None:
    """The custom call that produced `results` (emitted by Mosaic's lowering rule) as a Job."""
    if not results:
        return None
    op = results[0].owner
    op = getattr(op, "operation", op)
    names = [a if isinstance(a, str) else a.name for a in op.attributes]
    return Job(name, ctx.avals_in, ctx.avals_out, [str(r.type) for r in op.results],
               [(n, str(op.attributes[n])) for n in names])


def program(job: Job):
    """(function, argument shapes): a program whose only operation is the job's custom call,
    its attributes and types as captured."""
    import jax
    prim = _primitive()
    return ((lambda *xs: prim.bind(*xs, job=job)),
            [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in job.avals_in])


_PRIM = [None]


def _primitive():
    """The primitive that replays a captured custom call (registered for CUDA, once)."""
    if _PRIM[0] is not None:
        return _PRIM[0]
    from jax.interpreters import mlir
    from jax._src.lib.mlir import ir
    try:
        from jax.extend.core import Primitive
    except ImportError:        # older jax
        from jax.core import Primitive

    prim = Primitive("fla_mosaic_compile_ahead")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda *avals, job: list(job.avals_out))

    def lowering(ctx, *args, job):
        op = ir.Operation.create(
            "stablehlo.custom_call", results=[ir.Type.parse(t) for t in job.result_types],
            operands=list(args), attributes={n: ir.Attribute.parse(a) for n, a in job.attributes})
        return list(op.results)
    mlir.register_lowering(prim, lowering, platform="cuda")
    _PRIM[0] = prim
    return prim


def compile_job(job: Job) -> None:
    """Compile the job's one-kernel program for the default device (jaxlib keeps the kernel)."""
    import jax
    fn, shapes = program(job)
    jax.jit(fn).lower(*shapes).compile()


def _work():
    while True:
        job = _QUEUE.get()
        try:
            if job is None or _STOPPING[0]:
                return
            compile_job(job)
        except Exception as e:       # the real compile reports it
            FAILED.append(f"{job.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        finally:
            _QUEUE.task_done()


def _stop():
    """At exit: drop what is queued, let a compile in flight finish (within 60 s)."""
    _STOPPING[0] = True
    worker = _WORKER[0]
    if worker is not None and worker.is_alive():
        _QUEUE.put(None)
        worker.join(timeout=60)


def submit(job: Job) -> bool:
    """Queue the job's compile (once per kernel hash); True when queued."""
    if job.attributes in _SEEN:        # the kernel hash and module are among the attributes
        return False
    _SEEN.add(job.attributes)
    if _WORKER[0] is None:
        _WORKER[0] = threading.Thread(target=_work, name="fla-mosaic-compile-ahead",
                                      daemon=True)
        _WORKER[0].start()
        atexit.register(_stop)
    _QUEUE.put(job)
    return True


def wait() -> None:
    """Block until every queued compile has run (tests, benchmarks)."""
    if _WORKER[0] is not None:
        _QUEUE.join()


def _compiles_here(ctx) -> bool:
    """A CUDA lowering in a process whose default backend is a GPU, outside export_for_cuda."""
    import jax
    from .lowering import _LOWERING_ONLY
    if not COMPILE_AHEAD or _LOWERING_ONLY[0]:
        return False
    platforms = getattr(ctx.module_context, "platforms", ())
    return "cuda" in tuple(platforms) and jax.default_backend() == "gpu"


@functools.cache
def install() -> None:
    """Wrap Mosaic GPU's lowering rule (once): this library's kernels (kernel_cache.is_ours)
    are compiled as soon as they are lowered."""
    try:
        from jax.experimental.mosaic.gpu import core
    except ImportError:
        return
    rule = getattr(core, "_mosaic_gpu_lowering_rule", None)
    if rule is None:
        return
    from . import kernel_cache

    def lowering_rule(ctx, *args, module, **kw):
        name = kernel_cache._module_name(module)     # before the rule serializes it
        results = rule(ctx, *args, module=module, **kw)
        if kernel_cache.is_ours(name) and _compiles_here(ctx):
            job = capture(name, ctx, results)
            if job is not None:
                submit(job)
        return results
    lowering_rule.__wrapped__ = rule
    core._mosaic_gpu_lowering_rule = lowering_rule
