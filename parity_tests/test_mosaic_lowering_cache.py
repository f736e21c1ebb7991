"""Each Mosaic GPU kernel of this library lowered once per process and key
(fla_jax/ops/common/mosaic/lowering_cache.py). On a CPU machine (export_for_cuda): programs
lowered with the cache give the very custom calls (modules, hence kernel hashes) they give
without it; a training step reuses the forward's lowerings; a kernel that differs in anything
(a constant, a head size) is lowered anew."""
from __future__ import annotations

import collections
import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp

from fla_jax.ops.common.mosaic import export_for_cuda
from fla_jax.ops.common.mosaic import lowering_cache as lc
from fla_jax.ops.delta_rule import chunk_delta_rule
from fla_jax.ops.simple_gla import chunk_simple_gla

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16


def _calls(text: str) -> list[str]:
    """The Mosaic custom calls of a module's text, SSA names and locations dropped."""
    calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu_v2\(.*", text)
    return [re.sub(r" loc\(#loc\d*\)$", "", re.sub(r"%[\w#]+", "%", c)) for c in calls]


def _delta_programs():
    """The delta rule's forward and training step at a shape it splits into sequence pieces
    (T0, map pass, piece scans, forward, backward kernels)."""
    B, T, H, K = 1, 4096, 2, 128
    args = [S((B, T, H, K), BF)] * 3 + [S((B, T, H), BF), S((B, T, H, K), BF)]

    def f(q, k, v, beta):
        return chunk_delta_rule(q, k, v, beta, impl="mosaic")[0]

    def step(q, k, v, beta, do):
        _, vjp = jax.vjp(f, q, k, v, beta)
        return vjp(do)
    return (lambda *a: f(*a[:4])), step, args


def _fresh(monkeypatch, on: bool):
    monkeypatch.setattr(lc, "LOWERING_CACHE", on)
    monkeypatch.setattr(lc, "_CACHE", collections.OrderedDict())
    monkeypatch.setattr(lc, "STATS", {"hits": 0, "misses": 0, "skipped": 0})


def _lower_both():
    """Forward, then step, as new functions (jax's own caches would return the earlier
    program's lowering for the same function)."""
    fwd, step, args = _delta_programs()
    return [_calls(export_for_cuda(p, *args)) for p in (fwd, step)]


def test_cached_lowerings_give_the_same_custom_calls(monkeypatch):
    _fresh(monkeypatch, False)
    plain = _lower_both()
    assert lc.STATS["misses"] == 0
    _fresh(monkeypatch, True)
    cached = _lower_both()
    assert lc.STATS["hits"] >= 3, lc.STATS        # the step reuses T0, map pass, piece scan
    assert lc.STATS["skipped"] == 0
    assert len(plain[1]) >= 7 and 'kernel_hash = "' in plain[1][0]
    assert cached == plain


def test_a_different_constant_or_shape_is_lowered_anew(monkeypatch):
    _fresh(monkeypatch, True)
    B, T, H = 1, 128, 2

    def program(K, scale):
        args = [S((B, T, H, K), BF)] * 3 + [S((B, T, H), jnp.float32)]
        fn = lambda q, k, v, g: chunk_simple_gla(q, k, v, g=g, scale=scale, impl="mosaic")[0]
        return _calls(export_for_cuda(fn, *args))
    a, b, c = program(64, 0.125), program(64, 0.25), program(128, 0.125)
    assert lc.STATS["hits"] == 0 and lc.STATS["misses"] == 3 * len(a)
    assert a != b and a != c
    assert program(64, 0.25) == b and lc.STATS["hits"] == len(a)


def test_the_cache_keeps_the_kernels_used_last(monkeypatch):
    """At MAX_ENTRIES the kernel used longest ago is dropped (and lowered anew when asked for
    again); a hit counts as a use."""
    _fresh(monkeypatch, True)
    monkeypatch.setattr(lc, "MAX_ENTRIES", 2)
    B, T, H, K = 1, 128, 2, 64
    args = [S((B, T, H, K), BF)] * 3 + [S((B, T, H), jnp.float32)]

    def lower(scale):
        export_for_cuda(lambda q, k, v, g: chunk_simple_gla(q, k, v, g=g, scale=scale,
                                                            impl="mosaic")[0], *args)
    lower(0.1)
    lower(0.2)
    lower(0.1)                         # a hit: 0.1 is now the one used last
    assert (lc.STATS["hits"], lc.STATS["misses"]) == (1, 2)
    lower(0.3)                         # drops 0.2
    assert len(lc._CACHE) == 2
    lower(0.1)
    assert lc.STATS["hits"] == 2
    lower(0.2)
    assert lc.STATS["misses"] == 4


def test_off_and_dumping_lower_as_before(monkeypatch):
    def lower_forward():
        fwd, _, args = _delta_programs()
        export_for_cuda(fwd, *args)
    _fresh(monkeypatch, False)
    lower_forward()
    lower_forward()
    assert lc.STATS == {"hits": 0, "misses": 0, "skipped": 0}
    _fresh(monkeypatch, True)
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    lower_forward()
    assert lc.STATS["misses"] == 0 and lc._CACHE == {}
