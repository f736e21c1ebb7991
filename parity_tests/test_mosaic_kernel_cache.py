"""One compile per Mosaic kernel per process (fla_jax/ops/common/mosaic/kernel_cache.py): a
kernel lowered in two programs yields the same module, so the same hash in jaxlib's
compiled-kernel cache. jax 0.11 stamps every lowering with a fresh dump name; the stamp is
dropped for this library's kernels (unless Mosaic dumps are asked for) and kept for others'.
Runs on a CPU machine (export_for_cuda)."""
from __future__ import annotations

import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir

from fla_jax.ops.common.mosaic import export_for_cuda, kernel_cache
from fla_jax.ops.simple_gla import chunk_simple_gla

S = jax.ShapeDtypeStruct


def _modules(text: str) -> list[str]:
    return re.findall(r'module = "((?:[^"\\]|\\.)*)"', text)


def test_same_kernel_in_two_programs_has_one_module():
    """The forward's kernel, lowered alone and inside a training step, is one module."""
    B, T, H, K = 1, 128, 2, 64
    args = [S((B, T, H, K), jnp.bfloat16)] * 3 + [S((B, T, H), jnp.float32)]

    def fwd(q, k, v, g):
        return chunk_simple_gla(q, k, v, g=g, impl="mosaic")[0]

    def twice(q, k, v, g):     # another program around the same call
        return fwd(q, k, v, g) * 2

    first, second = _modules(export_for_cuda(fwd, *args)), _modules(export_for_cuda(twice, *args))
    assert first and len(first) == len(second)
    assert first == second, "the same kernel lowered twice gave different modules"


def _module(name: str):
    with ir.Context() as ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        m = ir.Module.create()
        m.operation.attributes["sym_name"] = ir.StringAttr.get(name)
        return ctx, m


class _Opts:
    def __init__(self, ptx=False):
        self.ptx = ptx


def _stamped(counter, ptx=False):
    """A stand-in for jax 0.11's get_or_set_dump_options: stamps a fresh name each call."""
    def stamp(module):
        counter[0] += 1
        module.operation.attributes[kernel_cache.STAMP] = ir.StringAttr.get(f"k_{counter[0]}")
        return _Opts(ptx)
    return stamp


def test_stamp_dropped_for_ours_kept_for_others_and_for_dumps(monkeypatch):
    from jax.experimental.mosaic.gpu import dialect
    counter = [0]
    monkeypatch.setattr(dialect, "get_or_set_dump_options", _stamped(counter), raising=False)
    monkeypatch.setattr(kernel_cache, "_INSTALLED", [False])
    monkeypatch.setattr(kernel_cache, "_OURS", set())
    kernel_cache.keep_hash_stable("fla_test_kernel")
    wrapped = dialect.get_or_set_dump_options
    assert getattr(wrapped, "__wrapped__", None) is not None

    ctx, ours = _module("fla_test_kernel")
    with ctx:
        wrapped(ours)
        assert kernel_cache.STAMP not in ours.operation.attributes
        _, theirs = _module("someone_elses_kernel")
    with theirs.context:
        wrapped(theirs)
        assert kernel_cache.STAMP in theirs.operation.attributes     # not ours: untouched
    assert counter[0] == 2

    # dumps asked for: the stamp stays (dump files keep distinct names)
    monkeypatch.setattr(kernel_cache, "_INSTALLED", [False])
    monkeypatch.setattr(dialect, "get_or_set_dump_options", _stamped(counter, ptx=True))
    kernel_cache.keep_hash_stable("fla_test_kernel")
    ctx, ours = _module("fla_test_kernel")
    with ctx:
        dialect.get_or_set_dump_options(ours)
        assert kernel_cache.STAMP in ours.operation.attributes
