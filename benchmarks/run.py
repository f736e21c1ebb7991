"""GPU benchmark: fwd and fwd+bwd of our Pallas and Triton kernels, the plain 'chunked' paths,
FLA (fla-core, when importable) and torch SDPA, in one run; ratios against FLA from the same run.

    PYTHONPATH=. python benchmarks/run.py [--ops simple_gla gated_delta_rule] [--json out.json]

Timing: torch with CUDA events (triton.testing.do_bench, median); JAX by wall clock around
block_until_ready over loops of 10 calls (median of 15 loops). Warm-up (compile, autotune) is
excluded and reported separately as each path's first-call time.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

SHAPES = {"B4T4096": dict(B=4, T=4096, H=16, HV=16, K=128, V=128),
          "B1T32768": dict(B=1, T=32768, H=16, HV=16, K=128, V=128),
          "GQA_H8HV16": dict(B=4, T=4096, H=8, HV=16, K=128, V=128)}
FLA_NAMES = {"simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla"),
             "delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule"),
             "gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")}


def make_numpy(op, s, seed=0):
    import numpy as np
    rng = np.random.default_rng(seed)
    B, T, H, HV, K, V = (s[n] for n in ("B", "T", "H", "HV", "K", "V"))
    x = {"q": rng.standard_normal((B, T, H, K), np.float32),
         "k": rng.standard_normal((B, T, H, K), np.float32),
         "v": rng.standard_normal((B, T, HV, V), np.float32),
         "do": rng.standard_normal((B, T, HV, V), np.float32)}
    x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
    if op in ("simple_gla", "gated_delta_rule"):
        x["g"] = -rng.uniform(0.01, 0.2, (B, T, HV)).astype(np.float32)
    if op in ("delta_rule", "gated_delta_rule"):
        x["beta"] = rng.uniform(0.05, 0.95, (B, T, HV)).astype(np.float32)
    return x


def torch_case(op, x, dtype, impl, fla=False):
    import importlib

    import torch
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    t = {n: torch.tensor(a, device="cuda") for n, a in x.items()}
    leaves = [t[n].to(dt).requires_grad_() for n in ("q", "k", "v")]
    extra = {n: t[n].requires_grad_() for n in ("g", "beta") if n in t}
    do = t["do"].to(dt)
    if fla:
        mod, name = FLA_NAMES[op]
        fn = getattr(importlib.import_module(mod), name)
        call = lambda: fn(*leaves, **extra)[0]  # noqa: E731
    else:
        import fla_torch.ops as ops
        fn = getattr(ops, f"chunk_{op}")
        call = lambda: fn(*leaves, **extra, impl=impl)[0]  # noqa: E731
    params = leaves + list(extra.values())

    def fwd():
        with torch.no_grad():
            return call()

    def fwdbwd():
        o = call()
        o.backward(do)
    return fwd, fwdbwd, params


def time_torch(fn, params):
    import torch
    import triton
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ms = triton.testing.do_bench(fn, warmup=50, rep=300, grad_to_none=params, return_mode="median")
    return ms, first


def jax_case(op, x, dtype, impl):
    import jax
    import jax.numpy as jnp

    import fla_jax.ops as ops
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[dtype]
    a = {n: jnp.asarray(v) for n, v in x.items()}
    qkv = [a[n].astype(dt) for n in ("q", "k", "v")]
    names = [n for n in ("g", "beta") if n in a]
    fn = getattr(ops, f"chunk_{op}")

    def f(q, k, v, *gates):
        return fn(q, k, v, **dict(zip(names, gates)), impl=impl)[0]
    args = qkv + [a[n] for n in names]
    do = a["do"].astype(dt)
    fwd = jax.jit(f)
    fwdbwd = jax.jit(lambda *p: jax.vjp(f, *p)[1](do))
    return (lambda: fwd(*args)), (lambda: fwdbwd(*args))


def time_jax(fn, loops=15, inner=10):
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    for _ in range(3):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples), first


def sdpa(x, dtype):
    import torch
    import torch.nn.functional as F
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    q, k, v = (torch.tensor(x[n], device="cuda").to(dt).transpose(1, 2).requires_grad_()
               for n in ("q", "k", "v"))
    do = torch.tensor(x["do"], device="cuda").to(dt).transpose(1, 2)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwdbwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    return fwd, fwdbwd, [q, k, v]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--ops", nargs="+", default=["simple_gla", "delta_rule", "gated_delta_rule"])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--paths", nargs="+", default=["fla", "triton", "pallas", "torch-chunked",
                                                   "jax-chunked", "sdpa"])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import jax
    import torch
    import triton
    rows = []
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "jax": jax.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    try:
        import fla
        env["fla"] = getattr(fla, "__version__", "?")
        try:   # timing only: skip FLA's guard against the Triton<3.7.1 Hopper miscompile
            import fla.ops.common.chunk_o as co
            co.TRITON_ABOVE_3_7_1 = True
        except Exception:
            pass
    except ImportError:
        env["fla"] = None
    print(json.dumps(env))
    for shape in args.shapes:
        s = SHAPES[shape]
        for op in args.ops:
            if shape.startswith("GQA") and op != "gated_delta_rule":
                continue
            x = make_numpy(op, s)
            for dtype in args.dtypes:
                for path in args.paths:
                    if path == "sdpa" and (op != "simple_gla" or shape.startswith("GQA")):
                        continue
                    if path == "fla" and env["fla"] is None:
                        continue
                    try:
                        if path in ("fla", "triton", "torch-chunked", "sdpa"):
                            if path == "sdpa":
                                fwd, fb, params = sdpa(x, dtype)
                            else:
                                impl = {"triton": "triton", "torch-chunked": "chunked"}.get(path)
                                fwd, fb, params = torch_case(op, x, dtype, impl, fla=path == "fla")
                            f_ms, f_first = time_torch(fwd, params)
                            b_ms, b_first = time_torch(fb, params)
                        else:
                            impl = "pallas" if path == "pallas" else "chunked"
                            fwd, fb = jax_case(op, x, dtype, impl)
                            f_ms, f_first = time_jax(fwd)
                            b_ms, b_first = time_jax(fb)
                        rows.append(dict(shape=shape, op=op, dtype=dtype, path=path, fwd_ms=f_ms,
                                         fwdbwd_ms=b_ms, first_s=f_first + b_first))
                        print(f"{shape} {op} {dtype} {path}: fwd {f_ms:.3f} ms, fwd+bwd "
                              f"{b_ms:.3f} ms, first calls {f_first + b_first:.1f} s", flush=True)
                    except Exception as e:   # a path that fails is reported, not hidden
                        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                        rows.append(dict(shape=shape, op=op, dtype=dtype, path=path, error=msg))
                        print(f"{shape} {op} {dtype} {path}: FAILED {msg}", flush=True)
                    finally:
                        torch.cuda.empty_cache()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


def print_table(rows):
    base = {(r["shape"], r["op"], r["dtype"]): r for r in rows
            if r["path"] == "fla" and "error" not in r}
    print(f"\n| shape | op | dtype | path | fwd ms | fwd+bwd ms | fwd vs FLA | fwd+bwd vs FLA | first call s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['op']} | {r['dtype']} | {r['path']} | failed: {r['error']} |||||")
            continue
        b = base.get((r["shape"], r["op"], r["dtype"]))
        rf = f"{r['fwd_ms'] / b['fwd_ms']:.2f}x" if b else "-"
        rb = f"{r['fwdbwd_ms'] / b['fwdbwd_ms']:.2f}x" if b else "-"
        print(f"| {r['shape']} | {r['op']} | {r['dtype']} | {r['path']} | {r['fwd_ms']:.3f} | "
              f"{r['fwdbwd_ms']:.3f} | {rf} | {rb} | {r['first_s']:.1f} |")


if __name__ == "__main__":
    main()
