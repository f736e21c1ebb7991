"""fla_jax context parallelism (cp_mesh_axis= inside jax.shard_map) on 4 and 2 virtual CPU
devices must reproduce the single-device op (outputs, final states, every gradient incl.
dh0) for the four chunk ops, batch and varlen (sequences crossing device boundaries), fp32
and bf16 (parity_tests/cp_cases.py). The sharded runs happen in a subprocess
(parity_tests/cp_jax_worker.py): the virtual device count must be set before jax starts,
and this suite's other tests start it with one device."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from . import cp_cases

WORLDS = (4, 2)   # every run on 4 devices; the varlen case in fp32 on 2 as well


@pytest.fixture(scope="module")
def cp_results():
    d = tempfile.mkdtemp(prefix="cp_jax_")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "parity_tests.cp_jax_worker", d], cwd=root,
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"cp_jax_worker failed:\n{proc.stderr[-4000:]}")
    return d


def _params():
    for world, case, spec, dtype in cp_cases.world_runs(*WORLDS):
        yield pytest.param(world, case, spec, dtype,
                           id=f"w{world}-{cp_cases.run_id(case, spec, dtype)}")


@pytest.mark.parametrize("world,case,spec,dtype", list(_params()))
def test_cp_equals_single_device(cp_results, world, case, spec, dtype):
    from . import jax_runner, torch_runner

    x = cp_cases.inputs(spec, case, dtype, torch_runner.round_to)
    cp = dict(np.load(os.path.join(cp_results, f"{cp_cases.run_id(case, spec, dtype)}"
                                                f"-w{world}.npz")))
    single = jax_runner.run(spec, case, "chunked", dtype, x)
    oracle = torch_runner.run(spec, case, "chunked", "fp64", x)
    rows = cp_cases.compare(cp, single, oracle, dtype)
    assert not cp_cases.failures(rows), cp_cases.failures(rows)


def test_cp_mesh_axis_outside_shard_map():
    import jax.numpy as jnp

    import fla_jax.ops as ops

    q = jnp.zeros((1, 8, 1, 16))
    with pytest.raises(ValueError, match="cp_mesh_axis"):
        ops.chunk_gla(q, q, q, q, cp_mesh_axis="cp", impl="chunked")
