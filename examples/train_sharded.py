"""Train the tiny LM data-parallel x context-parallel in PyTorch and in JAX, and check that
each framework's sharded run gives the losses of its single-device run.

    python examples/train_sharded.py                       # dp 2 x cp 2, both frameworks
    python examples/train_sharded.py --dp 1 --cp 4 --seq-len 256 --frameworks jax

Layout: dp x cp workers; worker (d, c) holds rows [d B/dp, (d+1) B/dp) of every batch and
tokens [c T/cp, (c+1) T/cp) of each row. The layers run inside
`layers.context_parallel.context_parallel(...)`, so every op call passes its recurrent state
across the cp workers (the ops' `cp_group=` / `cp_mesh_axis=`); everything else in the LM is
token-local. The loss is the mean over all B x T tokens.
- torch: one process per worker (torch.multiprocessing.spawn; gloo on CPU, NCCL with one GPU
  per process), DistributedDataParallel over all workers (it averages the gradients; each
  worker's backward already holds its cp slice's share of the other slices' gradients), a cp
  process group per data-parallel row.
- JAX: one jit over a (dp, cp) mesh; the loss and gradients are computed in a
  `jax.shard_map` (tokens P('dp', 'cp'), parameters replicated) and summed with psum; the
  optimizer update runs replicated. On CPU the devices are virtual
  (--xla_force_host_platform_device_count, set here before jax starts).
The single-device baselines are examples/train_tiny_lm.py's runs (same initial weights, drawn
once in torch, same batches, same AdamW recipe).

Short convolutions (their window reaches into the previous slice) and softmax attention are
not split yet: the Gated DeltaNet / DeltaNet layers are built with use_short_conv=False here,
in the baseline too, and layers.context_parallel refuses both.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))          # tiny_data, train_tiny_lm
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))   # the repo

# The layers warn that use_short_conv=False costs quality; this example turns it off on purpose.
warnings.filterwarnings("ignore", message=".*use_short_conv=False")

POLICIES = {"fp32": None, "bf16": "params=fp32,compute=bf16,output=fp32"}
AGREEMENT = {"fp32": 1e-4, "bf16": 2e-2}     # as examples/train_tiny_lm.py
ATTNS = ("gated_deltanet", "delta_net", "gla", "retention", "linear_attention")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="data-parallel workers")
    p.add_argument("--cp", type=int, default=2, help="context-parallel workers per row")
    p.add_argument("--frameworks", default="torch,jax")
    p.add_argument("--attn", default="gated_deltanet", choices=ATTNS)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--dtype", default="fp32", choices=sorted(POLICIES))
    p.add_argument("--device", default="auto", help="torch device: auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.batch_size % args.dp or args.seq_len % args.cp:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --dp {args.dp} and "
                f"--seq-len {args.seq_len} a multiple of --cp {args.cp}")
    return args


def build_config(args, vocab_size: int):
    from fla_torch.models import LMConfig
    kw = {"use_short_conv": False} if args.attn in ("gated_deltanet", "delta_net") else {}
    return LMConfig(vocab_size=vocab_size, hidden_size=args.hidden_size,
                    num_layers=args.num_layers, attn=args.attn, num_heads=args.num_heads,
                    head_dim=args.head_dim, policy=POLICIES[args.dtype], attn_kwargs=kw)


def _torch_worker(rank, world, args, cfg_dict, init_state, lrs, batches, store, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from fla_torch.interop import from_numpy
    from fla_torch.layers.context_parallel import context_parallel
    from fla_torch.models import CausalLM, LMConfig, lm_loss
    from fla_torch.models import train as torch_train

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world)
    d, c = divmod(rank, args.cp)
    groups = [dist.new_group(list(range(i * args.cp, (i + 1) * args.cp)))
              for i in range(args.dp)]                   # every rank creates every group
    model = CausalLM(LMConfig.from_dict(cfg_dict)).to(device)
    model.load_state_dict(from_numpy(init_state), strict=True)
    ddp = DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    opt = torch_train.adamw(model, lr=lrs[0], weight_decay=args.weight_decay)
    B, T = args.batch_size // args.dp, args.seq_len // args.cp
    losses = []
    for i, (x, y) in enumerate(batches):
        rows, cols = slice(d * B, (d + 1) * B), slice(c * T, (c + 1) * T)
        xl = torch.from_numpy(np.ascontiguousarray(x[rows, cols])).to(device)
        yl = torch.from_numpy(np.ascontiguousarray(y[rows, cols])).to(device)
        for group in opt.param_groups:
            group["lr"] = lrs[i]
        opt.zero_grad(set_to_none=True)
        with context_parallel(groups[d]):
            loss = lm_loss(ddp(xl), yl)         # mean over this worker's B x T tokens
        loss.backward()                         # DDP: gradients averaged over all workers
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    dist.destroy_process_group()
    if rank == 0:
        np.save(out, np.asarray(losses))


def torch_sharded(args, cfg, init_state, lrs, batches) -> list:
    import torch.multiprocessing as mp
    world = args.dp * args.cp
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "losses.npy")
        mp.spawn(_torch_worker, args=(world, args, cfg.to_dict(), init_state, lrs, batches,
                                      store, out), nprocs=world)
        return np.load(out).tolist()


def jax_sharded(args, cfg, init_state, lrs, batches) -> list:
    import jax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from fla_jax.interop import from_state_dict
    from fla_jax.layers.context_parallel import context_parallel
    from fla_jax.models import CausalLM, LMConfig, lm_loss
    from fla_jax.models import train as jax_train

    world = args.dp * args.cp
    devices = jax.devices()
    if len(devices) < world:
        raise SystemExit(f"jax sees {len(devices)} devices; --dp {args.dp} x --cp {args.cp} "
                         f"needs {world}")
    mesh = Mesh(np.asarray(devices[:world]).reshape(args.dp, args.cp), ("dp", "cp"))
    model = CausalLM(LMConfig.from_dict(cfg.to_dict()), rngs=nnx.Rngs(args.seed))
    from_state_dict(model, init_state)
    opt = jax_train.make_optimizer(model, jax_train.adamw(lrs, weight_decay=args.weight_decay))
    replicated, tokens = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp", "cp"))
    nnx.update(model, jax.device_put(nnx.state(model), replicated))
    nnx.update(opt, jax.device_put(nnx.state(opt), replicated))
    clip = args.clip_norm

    @nnx.jit
    def step(model, opt, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def local(params, rest, x, y):          # one worker: its rows and its time slice
            def loss_fn(p):
                with context_parallel("cp"):
                    logits = nnx.merge(graphdef, p, rest)(x)
                return lm_loss(logits, y) / world
            loss, grads = jax.value_and_grad(loss_fn)(params)
            return jax.lax.psum(loss, ("dp", "cp")), jax.lax.psum(grads, ("dp", "cp"))

        loss, grads = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("dp", "cp"),
                                                                 P("dp", "cp")),
                                    out_specs=(P(), P()), check_vma=False)(params, rest, x, y)
        opt.update(model, jax_train.clip_by_global_norm_torch(grads, clip))
        return loss

    return [float(step(model, opt, jax.device_put(x, tokens), jax.device_put(y, tokens)))
            for x, y in batches]


def single_device(framework, args, cfg, init_state, lrs, batches) -> list:
    from train_tiny_lm import JaxRun, TorchRun
    run = (TorchRun if framework == "torch" else JaxRun)(cfg, init_state, lrs, args)
    return [run.step(i, x, y) for i, (x, y) in enumerate(batches)]


def main(argv=None) -> int:
    args = parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    if not frameworks or any(f not in ("torch", "jax") for f in frameworks):
        raise SystemExit(f"--frameworks={args.frameworks!r}; expected a subset of torch,jax")
    world = args.dp * args.cp
    # Virtual CPU devices for JAX (ignored by a GPU backend); before jax initialises.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={world}"

    import torch

    from fla_torch.interop import to_numpy
    from fla_torch.models import CausalLM as TorchLM
    from fla_torch.models import train as torch_train
    from tiny_data import BatchSampler, load_corpus

    tok, train_ids, _ = load_corpus()
    cfg = build_config(args, tok.vocab_size)
    torch.manual_seed(args.seed)
    init_state = to_numpy(TorchLM(cfg))
    lrs = torch_train.lr_schedule(args.lr, args.steps)
    sampler = BatchSampler(train_ids, args.batch_size, args.seq_len, seed=args.seed)
    batches = [sampler.sample() for _ in range(args.steps)]
    print(f"model: {','.join(cfg.layer_types)} ({args.attn}, use_short_conv off where the "
          f"layer has it), hidden {cfg.hidden_size}; batch {args.batch_size} x {args.seq_len}; "
          f"dp {args.dp} x cp {args.cp} = {world} workers (each {args.batch_size // args.dp} "
          f"x {args.seq_len // args.cp} tokens); {args.steps} steps, {args.dtype}")

    status, tol = 0, AGREEMENT[args.dtype]
    for fw in frameworks:
        t0 = time.perf_counter()
        one = single_device(fw, args, cfg, init_state, lrs, batches)
        t1 = time.perf_counter()
        many = (torch_sharded if fw == "torch" else jax_sharded)(args, cfg, init_state, lrs,
                                                                 batches)
        t2 = time.perf_counter()
        diff = np.abs(np.asarray(one) - np.asarray(many))
        ok = bool(diff.max() <= tol)
        status |= 0 if ok else 1
        print(f"\n{fw}: single device {t1 - t0:.1f} s, dp {args.dp} x cp {args.cp} "
              f"{t2 - t1:.1f} s (incl. start-up / compile)")
        print(f"{'step':>5} {'one device':>12} {'sharded':>12} {'|diff|':>10}")
        for i in range(args.steps):
            if i < 5 or i == args.steps - 1 or i % max(1, args.steps // 10) == 0:
                print(f"{i:>5} {one[i]:>12.6f} {many[i]:>12.6f} {diff[i]:>10.2e}")
        print(f"{fw}: max |loss_sharded - loss_one_device| {diff.max():.3e} (first step "
              f"{diff[0]:.3e}) -> {'agree' if ok else 'DISAGREE'} (tolerance {tol:g})")
    return status


if __name__ == "__main__":
    sys.exit(main())
