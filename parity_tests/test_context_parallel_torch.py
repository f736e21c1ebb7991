"""fla_torch context parallelism (cp_group=) on CPU: gloo process groups of 2 and 4 ranks
(torch.multiprocessing spawn) must reproduce the single-device op (outputs, final states,
every gradient incl. dh0) for the four chunk ops, batch and varlen (sequences crossing rank
boundaries), fp32 and bf16 (parity_tests/cp_cases.py)."""
from __future__ import annotations

import os
import socket
import tempfile

import numpy as np
import pytest
import torch

from . import cp_cases, torch_runner
from .torch_distributed import leave_worker
from .cases import ACTIVATION, op_kwargs

WORLDS = (2, 4)   # every run on 2 ranks; the varlen case in fp32 on 4 as well


def _cp_run(spec, case, dtype, x, rank, world, group) -> dict:
    """This rank's CP results as float64 numpy: o and per-token gradients of its slice,
    ht and dh0 whole."""
    import fla_torch.ops as ops

    dt, gdt = torch_runner.DTYPES[dtype], torch.float32
    xl = cp_cases.slice_of(spec, x, rank, world, case.T)
    args, leaves = {}, {}
    for a in spec.args:
        if a.key in xl:
            t = torch.tensor(xl[a.key], dtype=dt if a.role == ACTIVATION else gdt)
            if a.differentiable:
                t.requires_grad_(True)
                leaves["d" + a.key] = t
            args[a.name] = t
    kw = op_kwargs(spec, case)
    if case.cu_seqlens is not None:
        kw["cu_seqlens"] = torch.tensor(case.cu_seqlens, dtype=torch.int32)
    o, ht = getattr(ops, spec.name)(**args, **kw, impl="chunked", cp_group=group)
    dht = torch.tensor(xl["dht"], dtype=gdt) * (1.0 if rank == 0 else 0.0)
    grads = torch.autograd.grad([o, ht], list(leaves.values()),
                                [torch.tensor(xl["do"], dtype=o.dtype), dht])
    out = {"o": o, "ht": ht, **dict(zip(leaves, grads))}
    for name, g in zip(leaves, grads):
        assert g.dtype == leaves[name].dtype, (name, g.dtype)
    return {n: t.detach().to(torch.float64).numpy() for n, t in out.items()}


def _worker(rank, world, port, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for case, spec, dtype in _runs(world):
            x = cp_cases.inputs(spec, case, dtype, torch_runner.round_to)
            res = _cp_run(spec, case, dtype, x, rank, world, dist.group.WORLD)
            np.savez(os.path.join(out_dir, f"{cp_cases.run_id(case, spec, dtype)}-{rank}.npz"),
                     **res)
    finally:
        dist.destroy_process_group()
    leave_worker()


def _runs(world):
    return [r[1:] for r in cp_cases.world_runs(*WORLDS) if r[0] == world]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_all() -> dict:
    """{world: directory of per-rank npz files}; one spawn per world size."""
    import torch.multiprocessing as mp

    dirs = {}
    for world in WORLDS:
        d = tempfile.mkdtemp(prefix=f"cp_torch_{world}_")
        mp.spawn(_worker, args=(world, _free_port(), d), nprocs=world, join=True)
        dirs[world] = d
    return dirs


def test_cp_equals_single_device():
    """Every run in one test, so that the processes are spawned once even under xdist."""
    dirs = _spawn_all()
    bad = []
    for world, case, spec, dtype in cp_cases.world_runs(*WORLDS):
        x = cp_cases.inputs(spec, case, dtype, torch_runner.round_to)
        rid = cp_cases.run_id(case, spec, dtype)
        parts = [dict(np.load(os.path.join(dirs[world], f"{rid}-{r}.npz")))
                 for r in range(world)]
        cp = cp_cases.assemble(spec, parts)
        single = torch_runner.run(spec, case, "chunked", dtype, x)
        oracle = torch_runner.run(spec, case, "chunked", "fp64", x)
        bad += [f"w{world} {rid} {f}" for f in
                cp_cases.failures(cp_cases.compare(cp, single, oracle, dtype))]
    assert not bad, "\n".join(bad)


def test_cp_group_errors():
    import fla_torch.ops as ops

    q = torch.zeros(1, 8, 1, 16)
    with pytest.raises(TypeError, match="cp_group"):
        ops.chunk_gla(q, q, q, q, cp_group="world", impl="chunked")
