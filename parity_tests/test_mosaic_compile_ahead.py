"""Compiling this library's Mosaic GPU kernels ahead, while the program still lowers
(fla_jax/ops/common/mosaic/compile_ahead.py). On a CPU machine: the replayed one-kernel program
carries the very custom call the real program has (so jaxlib's compiled-kernel cache, keyed by
its hash, serves the real compile), when a compile ahead is asked for, and the worker. The GPU
run measures what it saves (benchmarks/compile_time.py)."""
from __future__ import annotations

import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp

from fla_jax.ops.common.mosaic import compile_ahead as ca
from fla_jax.ops.common.mosaic import export_for_cuda, lowering
from fla_jax.ops.simple_gla import chunk_simple_gla

S = jax.ShapeDtypeStruct


def _calls(text: str) -> list[str]:
    """The Mosaic custom calls of a module's text, SSA names and locations dropped."""
    calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu_v2\(.*", text)
    return [re.sub(r" loc\(#loc\d*\)$", "", re.sub(r"%[\w#]+", "%", c)) for c in calls]


def _captured(monkeypatch):
    """Export a simple-GLA forward for CUDA with every kernel captured, not compiled."""
    jobs = []
    monkeypatch.setattr(ca, "_compiles_here", lambda ctx: True)
    monkeypatch.setattr(ca, "submit", lambda job: jobs.append(job) or True)
    B, T, H, K = 1, 128, 2, 64
    args = [S((B, T, H, K), jnp.bfloat16)] * 3 + [S((B, T, H), jnp.float32)]
    text = export_for_cuda(lambda q, k, v, g: chunk_simple_gla(q, k, v, g=g, impl="mosaic")[0],
                           *args)
    return jobs, text


def test_replayed_program_is_the_same_custom_call(monkeypatch):
    jobs, text = _captured(monkeypatch)
    real = _calls(text)
    assert len(jobs) == len(real) >= 1
    for job in jobs:
        fn, shapes = ca.program(job)
        replay = _calls(export_for_cuda(fn, *shapes))
        assert len(replay) == 1
        assert replay[0] in real, f"{job.name}: the replayed custom call differs"
        assert 'kernel_hash = "' in replay[0] and 'module = "' in replay[0]
        assert [tuple(a.shape) for a in job.avals_in] == [s.shape for s in shapes]


def test_a_changed_attribute_is_a_different_call(monkeypatch):
    """The comparison above can fail: a replay with one byte of the module changed differs."""
    jobs, text = _captured(monkeypatch)
    job = jobs[0]
    attrs = [(n, a.replace('module = "', 'module = "X', 1)) for n, a in job.attributes]
    bad = ca.Job(job.name, job.avals_in, job.avals_out, job.result_types, attrs)
    fn, shapes = ca.program(bad)
    assert _calls(export_for_cuda(fn, *shapes))[0] not in _calls(text)


class _Ctx:
    def __init__(self, platforms):
        self.module_context = type("M", (), {"platforms": platforms})()


def test_when_kernels_are_compiled_ahead(monkeypatch):
    ctx = _Ctx(("cuda",))
    assert not ca._compiles_here(ctx)          # this machine: no GPU backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert ca._compiles_here(ctx)
    assert not ca._compiles_here(_Ctx(("cpu",)))
    monkeypatch.setattr(lowering, "_LOWERING_ONLY", [True])       # export_for_cuda
    assert not ca._compiles_here(ctx)
    monkeypatch.setattr(lowering, "_LOWERING_ONLY", [False])
    monkeypatch.setattr(ca, "COMPILE_AHEAD", False)
    assert not ca._compiles_here(ctx)


def test_nothing_queued_on_a_cpu_machine(monkeypatch):
    queued = []
    monkeypatch.setattr(ca, "submit", lambda job: queued.append(job) or True)
    B, T, H, K = 1, 128, 2, 64
    args = [S((B, T, H, K), jnp.bfloat16)] * 3 + [S((B, T, H), jnp.float32)]
    export_for_cuda(lambda q, k, v, g: chunk_simple_gla(q, k, v, g=g, impl="mosaic")[0], *args)
    assert queued == []


def test_worker_compiles_each_kernel_once_and_survives_errors(monkeypatch):
    done = []

    def fake_compile(job):
        if job.name == "bad":
            raise RuntimeError("boom\nsecond line")
        done.append(job.name)
    monkeypatch.setattr(ca, "compile_job", fake_compile)
    monkeypatch.setattr(ca, "FAILED", [])
    monkeypatch.setattr(ca, "_SEEN", set())
    job = lambda name, tag: ca.Job(name, (), (), (), (("tag", tag),))
    assert ca.submit(job("bad", "1"))
    assert ca.submit(job("k1", "2"))
    assert not ca.submit(job("k1 again", "2"))      # the same custom call: queued once
    assert ca.submit(job("k2", "3"))
    ca.wait()
    assert done == ["k1", "k2"]
    assert ca.FAILED == ["bad: RuntimeError: boom"]


def test_only_this_librarys_kernels_are_compiled_ahead(monkeypatch):
    """tiles.build registers each kernel (kernel_cache.is_ours); another library's kernel
    lowered through the same rule is left alone."""
    from fla_jax.ops.common.mosaic import kernel_cache
    jobs, _ = _captured(monkeypatch)
    assert jobs and all(kernel_cache.is_ours(j.name) for j in jobs)
    assert "simple_gla_mosaic_fwd_ws" in [j.name for j in jobs]
    monkeypatch.setattr(kernel_cache, "is_ours", lambda name: False)
    again, _ = _captured(monkeypatch)
    assert again == []
