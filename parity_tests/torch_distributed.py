"""fla_torch under torch.distributed on CPU (gloo): the gradients of DDP and of FSDP2
(torch.distributed.fsdp.fully_shard) over `world` processes equal one process's gradients on
the whole batch. Each rank builds the same seeded module twice: one copy wrapped (DDP or
fully_shard on every block / sub-module, then the root), fed the rank's rows of the batch; one
plain copy fed the whole batch (the single-process reference). The loss is a mean over the
batch, so the data-parallel average of the ranks' gradients is the full-batch gradient.

`check(world, kinds, names)` spawns the processes (torch.multiprocessing.spawn), runs every
kind ('ddp', 'fsdp2') on every target (an LM `attn` from LM_ATTN or a layer case name from
layer_runners) and returns {(kind, target, param name): rel RMS} from rank 0; every rank
asserts its own gradients within TOL. cp_names: layer cases also run context parallel
('cp': each rank one time slice of every row, inside layers.context_parallel).
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile

import numpy as np

TOL = 1e-5          # fp32 (cases.TOLERANCE's fp32 row)
LM_KW = dict(vocab_size=40, hidden_size=32, num_layers=2, num_heads=2, head_dim=16)
LAYERS = ("gdn", "deltanet", "gla", "retention", "linear_attn", "attn")
# Context parallelism (layers.context_parallel): layers without short convolutions.
CP_LAYERS = ("gdn_noconv", "deltanet_noconv", "gla_unfused", "retention", "linear_attn")
LM_ATTN = ("gated_deltanet", "hybrid")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def _lm(attn: str):
    from fla_torch.models import CausalLM, LMConfig
    kw = dict(LM_KW, attn="gated_deltanet", attn_layers=[1]) if attn == "hybrid" else \
        dict(LM_KW, attn=attn)
    return CausalLM(LMConfig(**kw))


def _targets(what: str):
    """(name, build() -> module, batch(seed) -> (inputs, extra), loss(module, inputs, extra))."""
    import torch

    from fla_torch.models import lm_loss
    from .layer_runners import CASES_BY_NAME, HIDDEN, make_torch_layer

    if what in LM_ATTN:
        def batch():
            g = torch.Generator().manual_seed(7)
            x = torch.randint(0, LM_KW["vocab_size"], (4, 33), generator=g)
            return x[:, :-1], x[:, 1:]
        return lambda: _lm(what), batch, lambda m, x, y: lm_loss(m(x), y)
    case = CASES_BY_NAME.get(what) or _noconv(what)

    def batch():
        g = torch.Generator().manual_seed(7)
        return (torch.randn(4, case.T, HIDDEN, generator=g),
                torch.randn(4, case.T, HIDDEN, generator=g))
    return lambda: make_torch_layer(case), batch, lambda m, x, dy: (m(x)[0] * dy).mean()


def _noconv(what: str):
    """'<case>_noconv': the layer case with use_short_conv=False."""
    import dataclasses

    from .layer_runners import CASES_BY_NAME
    base = CASES_BY_NAME[what.removesuffix("_noconv")]
    return dataclasses.replace(base, name=what, kwargs=dict(base.kwargs, use_short_conv=False))


def _cp_grads(module, loss_of, x, y, rank: int, world: int):
    """Context parallel: this rank's time slice of every row, the layer inside
    layers.context_parallel(WORLD); parameter gradients summed over the ranks / world (the
    loss is the mean of the ranks' equal-sized means)."""
    import torch.distributed as dist

    from fla_torch.layers.context_parallel import context_parallel
    cols = slice(rank * x.shape[1] // world, (rank + 1) * x.shape[1] // world)
    with context_parallel(dist.group.WORLD):
        loss_of(module, x[:, cols], y[:, cols]).backward()
    for p in module.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    return module


def _wrap(module, kind: str, mesh):
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(module)
    from torch.distributed.fsdp import fully_shard
    for sub in getattr(module, "layers", []):      # CausalLM blocks: one FSDP unit each
        fully_shard(sub, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def _full(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _worker(rank: int, world: int, kinds: tuple, names: tuple, cp_names: tuple, store: str,
            out: str):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    errors = {}
    try:
        for kind, what in [(k, w) for k in kinds for w in names] + [("cp", w) for w in cp_names]:
            build, batch, loss_of = _targets(what)
            torch.manual_seed(0)
            plain = build()
            twin = copy.deepcopy(plain)
            x, y = batch()
            loss_of(plain, x, y).backward()
            if kind == "cp":
                wrapped = _cp_grads(twin, loss_of, x, y, rank, world)
            else:
                wrapped = _wrap(twin, kind, mesh)
                rows = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
                loss_of(wrapped, x[rows], y[rows]).backward()
            ref = dict(plain.named_parameters())
            for name, p in wrapped.named_parameters():
                name = name.removeprefix("module.")
                errors[(kind, what, name)] = _rel(_full(p.grad).detach().numpy(),
                                            ref[name].grad.detach().numpy())
    finally:
        dist.destroy_process_group()
    if rank == 0:
        np.save(out, np.array(sorted(errors.items()), dtype=object), allow_pickle=True)
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"rank {rank}: gradients off by more than {TOL:g}: {bad}"
    leave_worker()


def leave_worker():
    """End a spawned worker that finished and checked its work without the interpreter's
    teardown. With torch 2.13 (gloo, CPU) about 1 run in 50 aborted in that teardown after
    every rank had returned from its worker and destroyed its process group ("terminate
    called without an active exception", SIGABRT: a joinable C++ thread destroyed at exit),
    which mp.spawn reports as a failed rank. Call it only on success: an exception raised
    before it still fails the rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check(world: int, kinds: tuple, names: tuple, cp_names: tuple = ()) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "errors.npy")
        mp.spawn(_worker, args=(world, tuple(kinds), tuple(names), tuple(cp_names), store, out), nprocs=world)
        return {tuple(k): v for k, v in np.load(out, allow_pickle=True)}
