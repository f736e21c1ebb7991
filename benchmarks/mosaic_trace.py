"""Where each warpgroup of a Mosaic GPU kernel spends its time (GPU script; Mosaic's on-device
profiler): ours against jax-linear-attention's kernels of the same op, in one process.

Every kernel whose name matches --kernels is rebuilt with Mosaic's profiler on
(`CompilerParams(profile_space, profile_dir, profile_bounds_check)`: %clock stamps into SMEM per
warpgroup, a Perfetto trace per launch) and three kinds of named regions around the calls both
libraries make at trace time: `wait` (plgpu.barrier_wait: a stage landing, a peer's release),
`mma` (pl.run_scoped / pl.run_state: a wgmma with its wait, or a scoped allocation) and
`store_wait` (plgpu.wait_smem_to_gmem). The trace holds each warpgroup's first --space ranges
(later ones are dropped), i.e. its first chunks; per kernel and warpgroup this prints the time of
that window and its share in each region kind, averaged over the CTAs:

    python3 benchmarks/mosaic_trace.py --op simple_gla --shape B4T4096 --paths mosaic jla

Times are in the trace's clock (%clock cycles / 1000, "kcyc"). The SMEM for the stamps is
48 B x --space per CTA (three warpgroups): a kernel at the SMEM limit does not fit it.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import glob
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WARPGROUPS = 3


@contextlib.contextmanager
def profiled(pattern: str, space: int, out_dir: str):
    """Within: plgpu.kernel builds of kernels named like `pattern` carry the profiler (traces
    under out_dir/<kernel name>/), and the three region kinds are named at trace time."""
    import jax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    saved = {(plgpu, "kernel"): plgpu.kernel, (plgpu, "barrier_wait"): plgpu.barrier_wait,
             (plgpu, "wait_smem_to_gmem"): plgpu.wait_smem_to_gmem,
             (pl, "run_scoped"): pl.run_scoped, (pl, "run_state"): pl.run_state}
    names = {f.name for f in dataclasses.fields(plgpu.CompilerParams)}

    def kernel(body, *args, compiler_params=None, kernel_name=None, **kw):
        if compiler_params is not None and kernel_name and re.search(pattern, kernel_name):
            where = os.path.join(out_dir, kernel_name)
            os.makedirs(where, exist_ok=True)
            extra = dict(profile_space=space, profile_dir=where)
            if "profile_bounds_check" in names:     # jax >= 0.11: drop ranges past the space
                extra["profile_bounds_check"] = True
            compiler_params = dataclasses.replace(compiler_params, **extra)
        return saved[(plgpu, "kernel")](body, *args, compiler_params=compiler_params,
                                        kernel_name=kernel_name, **kw)

    def scoped(name, fn):
        def wrapped(*a, **kw):
            with jax.named_scope(name):
                return fn(*a, **kw)
        return wrapped

    def run_state(f, *a, **kw):
        return scoped("mma", saved[(pl, "run_state")](f, *a, **kw))

    patches = {(plgpu, "kernel"): kernel,
               (plgpu, "barrier_wait"): scoped("wait", saved[(plgpu, "barrier_wait")]),
               (plgpu, "wait_smem_to_gmem"): scoped("store_wait",
                                                    saved[(plgpu, "wait_smem_to_gmem")]),
               (pl, "run_scoped"): scoped("mma", saved[(pl, "run_scoped")]),
               (pl, "run_state"): run_state}
    try:
        for (mod, name), fn in patches.items():
            setattr(mod, name, fn)
        yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def summarize(trace: dict, warpgroups: int = WARPGROUPS) -> dict:
    """A Perfetto trace of one launch -> {warpgroup: {"window": mean span of its recorded
    ranges, <region>: mean time inside top-level ranges of that name, "other": the rest,
    "ranges": mean count}}, means over the CTAs (trace tids: 1 + warpgroup + warpgroups * CTA)."""
    per_tid = collections.defaultdict(list)
    for ev in trace["traceEvents"]:
        per_tid[ev["tid"]].append(ev)
    acc = collections.defaultdict(lambda: collections.defaultdict(list))
    for tid, events in per_tid.items():
        wg = (tid - 1) % warpgroups
        depth, start, total, count = 0, None, collections.Counter(), 0
        for ev in events:
            if ev["ph"] == "B":
                if depth == 0:
                    start = (ev["name"], ev["ts"])
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    total[start[0]] += ev["ts"] - start[1]
                    count += 1
        if not events:
            continue
        window = events[-1]["ts"] - events[0]["ts"]
        row = acc[wg]
        row["window"].append(window)
        row["ranges"].append(count)
        for name in set(total) | {"wait", "mma", "store_wait"}:
            row[name].append(total.get(name, 0.0))
        row["other"].append(window - sum(total.values()))
    return {wg: {k: sum(v) / len(v) for k, v in row.items()} for wg, row in acc.items()}


def table(label: str, summary: dict) -> str:
    lines = [f"{label}: per warpgroup, mean over CTAs (kcyc; share of its window)"]
    for wg in sorted(summary):
        s = summary[wg]
        w = s["window"] or 1.0
        parts = ", ".join(f"{k} {s[k]:.2f} ({100 * s[k] / w:.0f}%)"
                          for k in ("mma", "wait", "store_wait", "other") if k in s)
        lines.append(f"  WG{wg}: window {s['window']:.2f} over {s['ranges']:.0f} ranges: {parts}")
    return "\n".join(lines)


def latest_traces(out_dir: str) -> dict:
    """{kernel name: its last trace} under out_dir."""
    found = {}
    for where in sorted(glob.glob(os.path.join(out_dir, "*"))):
        files = sorted(glob.glob(os.path.join(where, "*-trace.json")), key=os.path.getmtime)
        if files:
            with open(files[-1]) as f:
                found[os.path.basename(where)] = json.load(f)
    return found


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="simple_gla")
    p.add_argument("--shape", default="B4T4096")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--paths", nargs="+", default=["mosaic", "jla"])
    p.add_argument("--kernels", default=".", help="regex on kernel names (default: all)")
    p.add_argument("--space", type=int, default=96, help="ranges recorded per warpgroup")
    p.add_argument("--step", action="store_true", help="the training step, not the forward")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import jax
    import run as bench
    x = bench.make_numpy(a.op, bench.SHAPES[a.shape])
    for path in a.paths:
        out_dir = os.path.join(a.out or tempfile.mkdtemp(prefix="mosaic_trace_"), path)
        with profiled(a.kernels, a.space, out_dir):
            fwd, step, args = (bench.jla_programs(a.op, x, a.dtype) if path == "jla"
                               else bench.jax_programs(a.op, x, a.dtype, path))
            fn = step if a.step else fwd
            jax.block_until_ready(fn(*args))
            jax.effects_barrier()       # the traces are written by host callbacks
        for name, trace in latest_traces(out_dir).items():
            print(table(f"{a.op} {a.shape} {a.dtype} {path} {name}", summarize(trace)),
                  flush=True)


if __name__ == "__main__":
    main()
