"""GPU benchmark: fwd and fwd+bwd of our Pallas and Triton kernels, our Pallas Mosaic GPU
kernels (path 'mosaic': ops that register impl='mosaic', bf16/fp16), the plain 'chunked' paths,
FLA (fla-core, when importable), jax-linear-attention's Mosaic GPU kernels (path 'jla', when
importable: jax 0.11.2 + equinox, Hopper, bf16/fp16) and torch SDPA, in one run; ratios against
FLA and against jla from the same run.

    PYTHONPATH=. python benchmarks/run.py [--ops simple_gla gated_delta_rule] [--json out.json]
    PYTHONPATH=. python benchmarks/run.py --dry-run [--ops gla]    # CPU check of the calls
    PYTHONPATH=. python benchmarks/run.py --ops attention --dtypes bf16   # softmax attention
        (ours vs SDPA flash and vs jax cuDNN, B=4 T=4096 H=16 D=128 causal: attention.py)

Timing: torch with CUDA events (triton.testing.do_bench, median); JAX by wall clock around
block_until_ready over loops of 10 calls (median of 15 loops). Warm-up (compile, autotune) is
excluded and reported separately as each path's first-call time. A JAX path's training step
takes do as an argument, as in training (FLA_BENCH_CONST_DO=1: closed over as a constant, the
harness before RESULTS.md run 28, which let XLA fold work on do alone -- e.g. GLA's transposed
copies of do -- and put a [B, T, HV, V] literal into every step program's compile).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

SHAPES = {"B4T4096": dict(B=4, T=4096, H=16, HV=16, K=128, V=128),
          "B1T32768": dict(B=1, T=32768, H=16, HV=16, K=128, V=128),
          "GQA_H8HV16": dict(B=4, T=4096, H=8, HV=16, K=128, V=128),
          "B4T4096K64": dict(B=4, T=4096, H=16, HV=16, K=64, V=64),        # RWKV-7's head size
          "GSA_H4M64": dict(B=4, T=4096, H=4, HV=4, K=64, V=64, M=64)}     # GSA (issue 14)

# jax-linear-attention's name of each family (jla.ops.linear_attention(kind, ...)).
JLA_KINDS = {"simple_gla": "simple_gla", "gla": "gla", "delta_rule": "deltanet",
             "gated_delta_rule": "gated_deltanet", "kda": "kda", "rwkv7": "rwkv7"}


def applies(shape: str, op: str) -> bool:
    """Which shapes each family is timed at: GQA for the grouped-head delta family, K=64 for
    RWKV-7 only (its head size; it has no K=128 row), the GSA shape for GSA only."""
    if op == "gsa" or shape == "GSA_H4M64":
        return op == "gsa" and shape == "GSA_H4M64"
    if shape == "GQA_H8HV16":
        return op in ("gated_delta_rule", "kda")
    if op == "rwkv7":
        return shape == "B4T4096K64"
    return shape != "B4T4096K64"


def _spec(op):
    from fla_contract import OPS
    return OPS[f"chunk_{op}"]


def make_numpy(op, s, seed=0):
    """float32 inputs of chunk_<op>, drawn by role from its OpSpec (fla_contract.op_spec): the
    activations and the output cotangent 'do' standard normal (k unit-norm), then log-decays
    in -[0.01, 0.2] and beta in [0.05, 0.95]."""
    import numpy as np

    from fla_contract.op_spec import BETA, GATE, GATE_K, GATE_SLOT, VECTOR_K
    spec = _spec(op)
    rng = np.random.default_rng(seed)
    # HQ / HKV: query and key/value heads of the grouped-query ops (GSA); M: GSA's slots
    sizes = dict(s, N=s["B"], HQ=s["HV"], HKV=s["H"], M=s.get("M", s["K"]))
    x = {a.name: rng.standard_normal(tuple(sizes[d] for d in a.shape), np.float32)
         for a in spec.activations}
    x["do"] = rng.standard_normal(tuple(sizes[d] for d in spec.arg("v").shape), np.float32)
    x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
    for a in spec.args:
        shape = tuple(sizes[d] for d in a.shape)
        if a.role in (GATE, GATE_K, GATE_SLOT):
            x[a.name] = -rng.uniform(0.01, 0.2, shape).astype(np.float32)
        elif a.role == BETA:
            x[a.name] = rng.uniform(0.05, 0.95, shape).astype(np.float32)
        elif a.role == VECTOR_K:   # RWKV-7: a = -kk, b = kk * u (kk a unit vector)
            kk = rng.standard_normal(shape).astype(np.float32)
            kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
            x["a"], x["b"] = -kk, kk * rng.uniform(0, 1, shape).astype(np.float32)
    return x


def _split(op, x):
    """(activation names in call order, names of the other differentiable inputs)."""
    from fla_contract.op_spec import ACTIVATION
    spec = _spec(op)
    acts = [a.name for a in spec.activations]
    extra = [a.name for a in spec.args if a.role != ACTIVATION and a.name in x]
    return acts, extra


def torch_case(op, x, dtype, impl, fla=False, device="cuda"):
    import importlib

    import torch
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    t = {n: torch.tensor(a, device=device) for n, a in x.items()}
    acts, names = _split(op, x)
    leaves = [t[n].to(dt).requires_grad_() for n in acts]
    extra = {n: t[n].requires_grad_() for n in names}
    do = t["do"].to(dt)
    if fla:   # FLA's module, function and argument names match ours
        fn = getattr(importlib.import_module(f"fla.ops.{op}"), f"chunk_{op}")
        named = dict(zip(acts, leaves))
        call = lambda: fn(**named, **extra)[0]  # noqa: E731
    else:
        import fla_torch.ops as ops
        fn = getattr(ops, f"chunk_{op}")
        named = dict(zip(acts, leaves))
        call = lambda: fn(**named, **extra, impl=impl)[0]  # noqa: E731
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


def training_step(f, do):
    """jit of (o, the input gradients for cotangent do): what a training step asks of the op.
    Returning o keeps its forward kernels in the program; with the gradients alone XLA drops a
    forward whose output the backward does not read (jla's and our Mosaic forward were timed
    that way before RESULTS.md run 14's last call)."""
    import jax

    def step(*p):
        o, vjp = jax.vjp(f, *p)
        return o, vjp(do)
    if os.environ.get("FLA_BENCH_CONST_DO"):
        return jax.jit(step)

    # do is an argument of the timed program, as in training (a constant do lets XLA fold
    # what the backward computes from do alone, e.g. a transpose)
    def step_do(d, *p):
        o, vjp = jax.vjp(f, *p)
        return o, vjp(d)
    jitted = jax.jit(step_do)

    def call(*p):
        return jitted(do, *p)
    call.traced_do = (jitted, do)     # jitted_program: the program for tools that lower it
    return call


def jitted_program(fn, args):
    """(the jitted program behind fn, its arguments): fn itself, or for a training step with do
    an argument (training_step), the jitted step and [do, *args]."""
    if hasattr(fn, "traced_do"):
        jitted, do = fn.traced_do
        return jitted, [do, *args]
    return fn, list(args)


def jax_programs(op, x, dtype, impl):
    """(jitted forward, jitted training step, their arguments) of chunk_<op>(impl=impl)."""
    import jax
    import jax.numpy as jnp

    import fla_jax.ops as ops
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[dtype]
    a = {n: jnp.asarray(v) for n, v in x.items()}
    acts, names = _split(op, x)
    fn = getattr(ops, f"chunk_{op}")

    def f(*args):
        named = dict(zip(acts + names, args))
        return fn(**named, impl=impl)[0]
    args = [a[n].astype(dt) for n in acts] + [a[n] for n in names]
    return jax.jit(f), training_step(f, a["do"].astype(dt)), args


def jax_case(op, x, dtype, impl):
    fwd, fwdbwd, args = jax_programs(op, x, dtype, impl)
    return (lambda: fwd(*args)), (lambda: fwdbwd(*args))


def jla_programs(op, x, dtype):
    """jax-linear-attention's Mosaic GPU kernel of the family: jla.ops.linear_attention(kind,
    q, k, v, <gates by name>, impl="mosaic_gpu"); RWKV-7's r goes in as q. (jitted forward,
    jitted training step, their arguments)."""
    import jax
    import jax.numpy as jnp
    from jla.ops import linear_attention
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[dtype]
    a = {n: jnp.asarray(v) for n, v in x.items()}
    acts, names = _split(op, x)
    kind = JLA_KINDS[op]

    def f(*args):
        named = dict(zip(acts + names, args))
        q, k, v = (named[n] for n in acts)
        return linear_attention(kind, q, k, v, impl="mosaic_gpu",
                                **{n: named[n] for n in names})[0]
    args = [a[n].astype(dt) for n in acts] + [a[n] for n in names]
    return jax.jit(f), training_step(f, a["do"].astype(dt)), args


def jla_case(op, x, dtype):
    fwd, fwdbwd, args = jla_programs(op, x, dtype)
    return (lambda: fwd(*args)), (lambda: fwdbwd(*args))


def has_mosaic(op) -> bool:
    """chunk_<op> registers Pallas Mosaic GPU kernels (impl='mosaic', Hopper, bf16/fp16)."""
    import importlib
    try:
        return "mosaic" in importlib.import_module(f"fla_jax.ops.{op}.interface").CHUNK_IMPLS
    except (ImportError, AttributeError):
        return False


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


def dry_run(ops, dtypes):
    """CPU check of the inputs and calls, no timing: each op's torch and JAX chunked paths,
    forward and forward+backward once, at a tiny shape (GQA for the grouped-head ops)."""
    if "attention" in ops:
        from attention import dry_run as attention_dry_run
        attention_dry_run(dtypes)
    for op in [o for o in ops if o != "attention"]:
        s = dict(B=1, T=40, H=1 if _spec(op).grouped_heads else 2, HV=2, K=16, V=16, M=16)
        x = make_numpy(op, s)
        for dtype in dtypes:
            fwd, fb, _ = torch_case(op, x, dtype, "chunked", device="cpu")
            fwd(), fb()
            jfwd, jfb = jax_case(op, x, dtype, "chunked")
            jfwd(), jfb()
            print(f"dry run {op} {dtype} ({', '.join(x)}): torch-chunked, jax-chunked ok",
                  flush=True)


def main(argv=None):
    from fla_contract import OPS
    families = sorted({spec.family for spec in OPS.values()})
    p = argparse.ArgumentParser()
    p.add_argument("--ops", nargs="+", default=["simple_gla", "delta_rule", "gated_delta_rule"],
                   choices=families, help="op families (chunk_<family>; 'attention': "
                                           "softmax attention, benchmarks/attention.py)")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp32"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--paths", nargs="+", default=["fla", "jla", "triton", "pallas", "mosaic",
                                                   "torch-chunked", "jax-chunked", "sdpa"])
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU, no timing: run each op's chunked paths once on CPU, tiny shape")
    args = p.parse_args(argv)
    if args.dry_run:
        return dry_run(args.ops, args.dtypes)

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
    try:
        import jla  # noqa: F401
        from importlib.metadata import version
        env["jla"] = version("jax-linear-attention")
    except Exception:
        env["jla"] = None
    print(json.dumps(env))
    if "attention" in args.ops:
        from attention import ATTN_SHAPES, run as run_attention
        run_attention(args.dtypes, list(ATTN_SHAPES), time_torch, time_jax, rows)
    for shape in args.shapes:
        s = SHAPES[shape]
        for op in [o for o in args.ops if o != "attention"]:
            if not applies(shape, op):
                continue
            if shape.startswith("GSA") and op != "gsa":
                continue
            x = make_numpy(op, s)
            for dtype in args.dtypes:
                for path in args.paths:
                    if path == "sdpa" and (op != "simple_gla" or shape.startswith("GQA")):
                        continue
                    if path == "fla" and env["fla"] is None:
                        continue
                    if path == "jla" and (env["jla"] is None or op not in JLA_KINDS):
                        continue
                    if path == "mosaic" and (dtype == "fp32" or not has_mosaic(op)):
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
                        elif path == "jla":
                            fwd, fb = jla_case(op, x, dtype)
                            f_ms, f_first = time_jax(fwd)
                            b_ms, b_first = time_jax(fb)
                        else:
                            impl = {"pallas": "pallas", "mosaic": "mosaic"}.get(path, "chunked")
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
    if "attention" in args.ops:
        from attention import ratio_lines
        print("\n" + "\n".join(ratio_lines(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


def print_table(rows):
    """One markdown row per (shape, op, dtype, path), with ratios against FLA and against
    jax-linear-attention measured in the same run ('-' where that peer has no row)."""
    def base(path):
        return {(r["shape"], r["op"], r["dtype"]): r for r in rows
                if r["path"] == path and "error" not in r}
    peers = {"FLA": base("fla"), "jla": base("jla")}
    head = "| shape | op | dtype | path | fwd ms | fwd+bwd ms |"
    for name in peers:
        head += f" fwd vs {name} | fwd+bwd vs {name} |"
    print("\n" + head + " first call s |")
    print("|---" * (head.count("|") - 1 + 1) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['op']} | {r['dtype']} | {r['path']} | failed: "
                  f"{r['error']} |" + "|" * 6)
            continue
        line = (f"| {r['shape']} | {r['op']} | {r['dtype']} | {r['path']} | {r['fwd_ms']:.3f} | "
                f"{r['fwdbwd_ms']:.3f} |")
        for b in peers.values():
            p = b.get((r["shape"], r["op"], r["dtype"]))
            line += (f" {r['fwd_ms'] / p['fwd_ms']:.2f}x | {r['fwdbwd_ms'] / p['fwdbwd_ms']:.2f}x |"
                     if p else " - | - |")
        print(line + f" {r['first_s']:.1f} |")


if __name__ == "__main__":
    main()
