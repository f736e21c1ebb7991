"""Context parallelism on 2 GPUs: parity with one GPU, and scaling of GDN fwd+bwd.

    NCCL_NVLS_ENABLE=0 python benchmarks/cp_scaling.py [--framework torch|jax|both]
        [--mode parity|bench|both] [--impl auto] [--T-parity 65536] [--T-bench 131072]

parity: every CP op (chunk_simple_gla, chunk_gla, chunk_delta_rule, chunk_gated_delta_rule)
    at T = --T-parity split in two (B=1, H=4, K=V=128, bf16; a batch case with an initial
    state and a varlen case whose middle sequence crosses the split): CP outputs, final
    states and every gradient (dh0 included) vs the same op on one GPU, RMS(a - b) / RMS(b)
    within parity_tests/cases.py TOLERANCE.
bench: chunk_gated_delta_rule fwd+bwd (B=1, H=16, K=V=128, bf16) at T = --T-bench on 2 GPUs
    (T/2 each) vs 1 GPU at T/2; efficiency = t(1 GPU, T/2) / t(2 GPUs, T).
torch: two processes (torch.multiprocessing spawn, NCCL, cp_group=WORLD); JAX: one process,
jax.shard_map over a 2-device mesh (cp_mesh_axis="cp"). NCCL's NVLink multicast stays off
(NCCL_NVLS_ENABLE=0 is set here before any NCCL use). Results: printed, and written to
$OUT/cp_scaling_<framework>.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OPS = ("chunk_simple_gla", "chunk_gla", "chunk_delta_rule", "chunk_gated_delta_rule")
SHAPE_PARITY = dict(B=1, H=4, K=128, V=128)
SHAPE_BENCH = dict(B=1, H=16, K=128, V=128)


def make_inputs(np_rng_seed, op, T, B, H, K, V, h0, cu):
    """float32 numpy inputs by public argument name (activations rounded later)."""
    import numpy as np
    rng = np.random.default_rng(np_rng_seed)
    x = {"q": rng.standard_normal((B, T, H, K), np.float32),
         "k": rng.standard_normal((B, T, H, K), np.float32),
         "v": rng.standard_normal((B, T, H, V), np.float32)}
    if "delta" in op:
        x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
        x["beta"] = rng.uniform(0.02, 0.98, (B, T, H)).astype(np.float32)
    else:
        x["k"] /= np.sqrt(K)
    if op == "chunk_gla":
        x["g"] = -rng.uniform(0.001, 0.05, (B, T, H, K)).astype(np.float32)
    elif op != "chunk_delta_rule":
        x["g"] = -rng.uniform(0.001, 0.05, (B, T, H)).astype(np.float32)
    N = B if cu is None else len(cu) - 1
    if h0:
        x["initial_state"] = 0.5 * rng.standard_normal((N, H, K, V), np.float32)
    x["do"] = rng.standard_normal((B, T, H, V), np.float32)
    x["dht"] = 0.5 * rng.standard_normal((N, H, K, V), np.float32)
    return x


def parity_cases(T):
    return [("batch", None, True), ("varlen", (0, T // 64, T // 2 + T // 84, T), True)]


def check(name, cp, single, dtype):
    from parity_tests.cases import rel_rms, tolerance
    rows = []
    for key in single:
        err = rel_rms(cp[key], single[key], single[key])
        tol = tolerance(dtype, key)
        rows.append(dict(case=name, tensor=key, err=err, tol=tol, passed=bool(err <= tol)))
        print(f"  {name:40s} {key:6s} {err:.2e} (tol {tol:.1e}) "
              f"{'ok' if err <= tol else 'FAIL'}", flush=True)
    return rows


# ----------------------------------------------------------------------------- torch
def _torch_run(op, x, dtype, impl, rank, world, group, device, cu):
    """Returns (results dict of float32 numpy: o / per-token grads for the local slice,
    ht and dh0 whole)."""
    import torch
    import fla_torch.ops as ops
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    T = x["q"].shape[1]
    Tl = T // world
    sl = slice(rank * Tl, (rank + 1) * Tl)
    args, leaves = {}, {}
    for n, a in x.items():
        if n in ("do", "dht"):
            continue
        t = torch.tensor(a[:, sl] if n != "initial_state" else a, device=device)
        t = t.to(dt if n in ("q", "k", "v") else torch.float32).requires_grad_(True)
        args[n] = leaves["d" + ("h0" if n == "initial_state" else n)] = t
    kw = dict(output_final_state=True, impl=impl)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    if group is not None:
        kw["cp_group"] = group
    o, ht = getattr(ops, op)(**args, **kw)
    dht = torch.tensor(x["dht"], device=device) * (1.0 if rank == 0 else 0.0)
    grads = torch.autograd.grad([o, ht], list(leaves.values()),
                                [torch.tensor(x["do"][:, sl], device=device).to(o.dtype), dht])
    out = {"o": o, "ht": ht, **dict(zip(leaves, grads))}
    return {n: t.detach().float() for n, t in out.items()}


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_worker(rank, world, port, args, queue):
    import torch
    import torch.distributed as dist
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    group = dist.group.WORLD
    rows, bench = [], {}
    if args.mode in ("parity", "both"):
        for op in OPS:
            for name, cu, h0 in parity_cases(args.T_parity):
                x = make_inputs(1, op, args.T_parity, **SHAPE_PARITY, h0=h0, cu=cu)
                cp = _torch_run(op, x, "bf16", args.impl, rank, world, group, device, cu)
                gathered = {}
                for n, t in cp.items():
                    if n in ("ht", "dh0"):
                        gathered[n] = t.cpu().numpy()
                        continue
                    parts = [torch.empty_like(t) for _ in range(world)]
                    dist.all_gather(parts, t.contiguous())
                    gathered[n] = torch.cat(parts, dim=1).cpu().numpy()
                if rank == 0:
                    single = _torch_run(op, x, "bf16", args.impl, 0, 1, None, device, cu)
                    single = {n: t.cpu().numpy() for n, t in single.items()}
                    rows += check(f"torch {op} {name}", gathered, single, "bf16")
                dist.barrier()
    if args.mode in ("bench", "both"):
        bench = _torch_bench(args, rank, world, group, device)
    if rank == 0:
        queue.put({"parity": rows, "bench": bench})
    dist.destroy_process_group()


def _torch_bench(args, rank, world, group, device):
    import torch
    import torch.distributed as dist
    import fla_torch.ops as ops
    T = args.T_bench
    B, H, K, V = (SHAPE_BENCH[s] for s in "BHKV")

    def inputs(Tl):
        g = torch.Generator(device=device).manual_seed(rank)
        r = lambda *s: torch.randn(*s, device=device, generator=g)
        q = r(B, Tl, H, K).bfloat16().requires_grad_()
        k = torch.nn.functional.normalize(r(B, Tl, H, K), dim=-1).bfloat16().requires_grad_()
        v = r(B, Tl, H, V).bfloat16().requires_grad_()
        gg = (-0.05 * torch.rand(B, Tl, H, device=device, generator=g)).requires_grad_()
        beta = torch.rand(B, Tl, H, device=device, generator=g).requires_grad_()
        return q, k, v, gg, beta, r(B, Tl, H, V).bfloat16()

    def step(tensors, cp):
        q, k, v, gg, beta, do = tensors
        kw = {"cp_group": group} if cp else {}
        o, _ = ops.chunk_gated_delta_rule(q, k, v, gg, beta, impl=args.impl, **kw)
        torch.autograd.grad(o, [q, k, v, gg, beta], do)

    def timed(fn, barrier):
        """Median ms of fn over args.iters calls after 3 warm-up calls."""
        for _ in range(3):
            fn()
        _sync(device)
        ts = []
        for _ in range(args.iters):
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2] * 1e3

    cp_in = inputs(T // world)
    t_cp = timed(lambda: step(cp_in, True), barrier=True)
    del cp_in
    t_one = None
    dist.barrier()
    if rank == 0:   # one GPU, half the length, no collectives; rank 1 waits
        one_in = inputs(T // world)
        t_one = timed(lambda: step(one_in, False), barrier=False)
        del one_in
    dist.barrier()
    res = {"op": "chunk_gated_delta_rule", "T": T, **SHAPE_BENCH, "dtype": "bf16",
           "ms_2gpu_T": t_cp, "ms_1gpu_T_half": t_one,
           "efficiency": None if t_one is None else t_one / t_cp}
    if rank == 0:
        print(f"torch GDN fwd+bwd: 2 GPUs T={T}: {t_cp:.2f} ms; 1 GPU T={T // world}: "
              f"{t_one:.2f} ms; efficiency {t_one / t_cp:.1%}", flush=True)
    return res


def run_torch(args):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_torch_worker, args=(2, port, args, queue), nprocs=2, join=True,
                       start_method="spawn")
    return queue.get()


# ----------------------------------------------------------------------------- JAX
def run_jax(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import fla_jax.ops as ops

    devs = jax.devices()
    if len(devs) < 2:
        raise SystemExit(f"JAX sees {len(devs)} device(s); CP needs 2")
    mesh = Mesh(np.array(devs[:2]), ("cp",))
    per_token = ("q", "k", "v", "g", "beta")

    def fwd_bwd_fn(op, names, cu, cp, impl):
        fn = getattr(ops, op)

        def local(cu_, *a):
            kw = dict(zip(names, a), output_final_state=True, impl=impl)
            if cu_ is not None:
                kw["cu_seqlens"] = cu_
            if cp:
                kw["cp_mesh_axis"] = "cp"
            return fn(**kw)

        if cp:
            local = jax.shard_map(
                local, mesh=mesh,
                in_specs=(None if cu is None else P(),
                          *(P(None, "cp") if n in per_token else P() for n in names)),
                out_specs=(P(None, "cp"), P()),
                check_vma=False)   # Pallas out_shapes carry no varying-axis types yet

        @jax.jit
        def run(cu_, do, dht, *a):
            (o, ht), vjp = jax.vjp(lambda *t: local(cu_, *t), *a)
            return o, ht, vjp((do.astype(o.dtype), dht))
        return run

    rows, bench = [], {}
    if args.mode in ("parity", "both"):
        for op in OPS:
            for name, cu, h0 in parity_cases(args.T_parity):
                x = make_inputs(1, op, args.T_parity, **SHAPE_PARITY, h0=h0, cu=cu)
                names = [n for n in x if n not in ("do", "dht")]
                arrs = [jnp.asarray(x[n]).astype(jnp.bfloat16 if n in ("q", "k", "v")
                                                 else jnp.float32) for n in names]
                cu_ = None if cu is None else jnp.asarray(cu, jnp.int32)
                do, dht = jnp.asarray(x["do"]), jnp.asarray(x["dht"])
                res = {}
                for cp in (True, False):
                    o, ht, grads = fwd_bwd_fn(op, names, cu, cp, args.impl)(cu_, do, dht, *arrs)
                    out = {"o": o, "ht": ht}
                    out.update({"d" + ("h0" if n == "initial_state" else n): gr
                                for n, gr in zip(names, grads)})
                    res[cp] = {n: np.asarray(jnp.asarray(t, jnp.float32)) for n, t in out.items()}
                rows += check(f"jax {op} {name}", res[True], res[False], "bf16")
    if args.mode in ("bench", "both"):
        T = args.T_bench
        B, H, K, V = (SHAPE_BENCH[s] for s in "BHKV")
        times = {}
        for cp, Tn in ((True, T), (False, T // 2)):
            rng = np.random.default_rng(0)
            kk = rng.standard_normal((B, Tn, H, K), np.float32)
            x = {"q": rng.standard_normal((B, Tn, H, K), np.float32),
                 "k": kk / np.linalg.norm(kk, axis=-1, keepdims=True),
                 "v": rng.standard_normal((B, Tn, H, V), np.float32),
                 "g": -0.05 * rng.uniform(size=(B, Tn, H)).astype(np.float32),
                 "beta": rng.uniform(size=(B, Tn, H)).astype(np.float32)}
            names = list(x)
            arrs = [jnp.asarray(x[n]).astype(jnp.bfloat16 if n in ("q", "k", "v")
                                             else jnp.float32) for n in names]
            do = jnp.asarray(rng.standard_normal((B, Tn, H, V), np.float32)).astype(jnp.bfloat16)
            dht = jnp.zeros((B, H, K, V), jnp.float32)
            if not cp:
                arrs = [jax.device_put(a, devs[0]) for a in arrs]
                do, dht = jax.device_put(do, devs[0]), jax.device_put(dht, devs[0])
            fn = fwd_bwd_fn("chunk_gated_delta_rule", names, None, cp, args.impl)
            for _ in range(3):
                jax.block_until_ready(fn(None, do, dht, *arrs))
            ts = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(None, do, dht, *arrs))
                ts.append(time.perf_counter() - t0)
            times[cp] = sorted(ts)[len(ts) // 2] * 1e3
        bench = {"op": "chunk_gated_delta_rule", "T": T, **SHAPE_BENCH, "dtype": "bf16",
                 "ms_2gpu_T": times[True], "ms_1gpu_T_half": times[False],
                 "efficiency": times[False] / times[True]}
        print(f"jax GDN fwd+bwd: 2 GPUs T={T}: {times[True]:.2f} ms; 1 GPU T={T // 2}: "
              f"{times[False]:.2f} ms; efficiency {bench['efficiency']:.1%}", flush=True)
    return {"parity": rows, "bench": bench}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=("torch", "jax", "both"), default="both")
    ap.add_argument("--mode", choices=("parity", "bench", "both"), default="both")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--T-parity", type=int, default=65536)
    ap.add_argument("--T-bench", type=int, default=131072)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke test of this script (gloo, 2 virtual JAX devices)")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=2")
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.framework == "both":   # one framework per process: each holds GPU memory
        rc = 0
        for fw in ("torch", "jax"):
            rc |= subprocess.call([
                sys.executable, __file__, "--framework", fw, "--mode", args.mode,
                "--impl", args.impl, "--T-parity", str(args.T_parity), "--T-bench",
                str(args.T_bench), "--iters", str(args.iters), "--device", args.device])
        sys.exit(rc)
    res = run_torch(args) if args.framework == "torch" else run_jax(args)
    failed = [r for r in res["parity"] if not r["passed"]]
    print(f"{args.framework}: parity {len(res['parity']) - len(failed)}/{len(res['parity'])} "
          f"passed", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"cp_scaling_{args.framework}.json"),
                  "w") as f:
            json.dump(res, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
