"""Where the time goes: device time per kernel of one op's fwd and fwd+bwd, for our paths and
the peers', at the benchmark shape (GPU). Complements run.py, which only gives totals.

    PYTHONPATH=. python benchmarks/kernel_profile.py --ops kda rwkv7 --paths triton fla pallas jla
    PYTHONPATH=. python benchmarks/kernel_profile.py --dry-run --ops gla   # CPU: tiny shape, host trace

torch paths ('triton', 'fla'): torch.profiler (CUDA activity), kernels grouped by name.
JAX paths ('pallas', 'mosaic', 'jla'): jax.profiler's perfetto trace, the events of the device
processes grouped by name. Torch and JAX paths asked for together run in one process each
(CUPTI serves one profiler per process: after torch.profiler, jax.profiler saw no GPU). Each table line: kernel, launches per call, microseconds per call and
share of the device time; the footer gives device-busy time against the wall time per call (the
gap is host enqueue and idle device). Shapes: run.py's, the first one applies() gives the op.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

import run

TORCH_PATHS = ("triton", "fla")
JAX_PATHS = ("pallas", "mosaic", "jla")
TINY = dict(B=1, T=128, H=2, HV=2, K=32, V=32, M=32)


def _shape_of(op: str) -> str:
    return next(s for s in run.SHAPES if run.applies(s, op))


def torch_profile(fn, params, iters: int, device: str) -> tuple[dict, float]:
    """({kernel name: (launches, us) summed over iters}, wall ms per call)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
        for p in params:
            p.grad = None
    sync()
    with profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
            for p in params:
                p.grad = None
        sync()
        wall = (time.perf_counter() - t0) * 1e3 / iters
    table = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) if device == "cuda" else None
        if us is None:
            us = getattr(evt, "cuda_time_total", 0) if device == "cuda" else evt.self_cpu_time_total
        if us > 0:
            table[evt.key] = (evt.count, float(us))
    return table, wall


def _trace_events(logdir: str):
    # the profiler's own Chrome-trace export, else the perfetto one (both are trace-event JSON)
    paths = (glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True)
             or glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no trace under {logdir}")
    with gzip.open(paths[0], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def jax_profile(fn, iters: int) -> tuple[dict, float]:
    """({op or kernel name: (launches, us) summed over iters}, wall ms per call). Events of the
    processes named /device:... or ...GPU... (the GPU streams); without any (CPU), those of the
    host threads."""
    import jax
    for _ in range(2):
        jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(iters):
                out = fn()
            jax.block_until_ready(out)
            wall = (time.perf_counter() - t0) * 1e3 / iters
        events = _trace_events(logdir)
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, n in names.items() if n.startswith("/device:") or "GPU" in n}
    keep = device or set(names)
    table = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in keep and "dur" in e:
            row = table[e["name"]]
            row[0] += 1
            row[1] += float(e["dur"])
    return {k: tuple(v) for k, v in table.items()}, wall


def report(title: str, table: dict, wall_ms: float, iters: int, top: int) -> dict:
    busy = sum(us for _, us in table.values()) / iters
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
    print(f"== {title}: wall {wall_ms:.3f} ms/call, device busy {busy / 1e3:.3f} ms/call")
    for name, (count, us) in rows:
        share = us / iters / busy if busy else 0.0
        print(f"  {us / iters:9.1f} us  {count / iters:5.1f}x  {share:6.1%}  {name[:110]}")
    return dict(title=title, wall_ms=wall_ms, busy_ms=busy / 1e3,
                kernels=[dict(name=n, launches=c / iters, us=u / iters) for n, (c, u) in rows])


def profile_path(op: str, path: str, dtype: str, sizes: dict, iters: int, top: int,
                 device: str) -> list[dict]:
    x = run.make_numpy(op, sizes)
    out = []
    if path in TORCH_PATHS:
        fwd, fb, params = run.torch_case(op, x, dtype, "triton", fla=path == "fla", device=device)
        for what, fn in (("fwd", fwd), ("fwd+bwd", fb)):
            table, wall = torch_profile(fn, params, iters, device)
            out.append(report(f"{op} {dtype} {path} {what}", table, wall, iters, top))
    else:
        fwd, fb = run.jla_case(op, x, dtype) if path == "jla" else \
            run.jax_case(op, x, dtype, path)
        for what, fn in (("fwd", fwd), ("fwd+bwd", fb)):
            table, wall = jax_profile(fn, iters)
            out.append(report(f"{op} {dtype} {path} {what}", table, wall, iters, top))
    return out


def _per_framework(args, groups) -> list:
    """Runs this script once per path group (torch paths, JAX paths), merging their results."""
    results = []
    for paths in groups:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "profile.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--ops", *args.ops, "--paths",
                   *paths, "--dtypes", *args.dtypes, "--iters", str(args.iters), "--top",
                   str(args.top), "--json", out] + (["--dry-run"] if args.dry_run else [])
            cmd += ["--shape", args.shape] if args.shape else []
            proc = subprocess.run(cmd)
            if os.path.exists(out):
                with open(out) as f:
                    results += json.load(f)
            else:
                results.append(dict(title=f"{' '.join(args.ops)} {' '.join(paths)}",
                                    error=f"profiling process exited with {proc.returncode}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def main(argv=None):
    from fla_contract import OPS
    families = sorted({s.family for s in OPS.values()} - {"attention"})
    p = argparse.ArgumentParser()
    p.add_argument("--ops", nargs="+", required=True, choices=families)
    p.add_argument("--paths", nargs="+", default=["triton", "fla", "pallas"],
                   choices=TORCH_PATHS + JAX_PATHS)
    p.add_argument("--dtypes", nargs="+", default=["bf16"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--shape", default=None, help="a run.py shape (default: the op's first)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shape, interpreted kernels: checks the calls and the parsing")
    args = p.parse_args(argv)
    groups = [g for g in ([x for x in args.paths if x in TORCH_PATHS],
                          [x for x in args.paths if x in JAX_PATHS]) if g]
    if len(groups) > 1:
        # one process per framework: CUPTI takes one subscriber per process, so jax.profiler
        # records nothing on the GPU after torch.profiler ran in the same process
        return _per_framework(args, groups)
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:   # before triton / jax are imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results = []
    for op in args.ops:
        sizes = TINY if args.dry_run else run.SHAPES[args.shape or _shape_of(op)]
        for dtype in args.dtypes:
            for path in args.paths:
                try:
                    results += profile_path(op, path, dtype, sizes, args.iters, args.top, device)
                except Exception as e:   # a path that fails is reported, not hidden
                    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    print(f"== {op} {dtype} {path}: FAILED {msg}", flush=True)
                    results.append(dict(title=f"{op} {dtype} {path}", error=msg))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
