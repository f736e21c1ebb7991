"""GPU timing of the Pallas chunk_gla (chunk engine, GATE_KEY): the whole op (fwd, fwd+bwd) per
dtype, each engine kernel alone, and launch variants through engine.launch.OVERRIDES.

    PYTHONPATH=. python benchmarks/pallas_gla_tune.py [--dtypes bf16 fp16 fp32] [--kernels]
        [--variants] [--fla] [--budget SECONDS]

Shape B=4 T=4096 H=16 K=V=128. Timing as benchmarks/run.py (wall clock around
block_until_ready, median of loops of 10 calls). Each line is printed when measured, so a run
cut short keeps what it reached; --budget stops starting new measurements after that many s.
"""
from __future__ import annotations

import argparse
import statistics
import time

T0 = time.time()
B, T, H, K, V = 4, 4096, 16, 128, 128


def ms(fn, loops=9, inner=10):
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    jax.block_until_ready(fn())
    samples = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples), first


def inputs(dtype):
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[dtype]
    q = jax.random.normal(ks[0], (B, T, H, K), jnp.float32).astype(dt)
    k = jax.random.normal(ks[1], (B, T, H, K), jnp.float32)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dt)
    v = jax.random.normal(ks[2], (B, T, H, V), jnp.float32).astype(dt)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H, K), jnp.float32)) / 16
    do = jax.random.normal(ks[4], (B, T, H, V), jnp.float32).astype(dt)
    return q, k, v, g, do


def whole_op(dtype, tag=""):
    import jax

    from fla_jax.ops.gla.pallas_chunk import chunk_gla_pallas
    q, k, v, g, do = inputs(dtype)

    def f(q, k, v, g):
        return chunk_gla_pallas(q, k, v, g=g, scale=K ** -0.5)[0]
    fwd = jax.jit(f)
    fb = jax.jit(lambda *a: jax.vjp(f, *a)[1](do))
    a, fa = ms(lambda: fwd(q, k, v, g))
    b, fbt = ms(lambda: fb(q, k, v, g))
    print(f"OP {tag} pallas chunk_gla {dtype}: fwd {a:.3f} ms  fwd+bwd {b:.3f} ms  "
          f"(first calls {fa:.1f} s / {fbt:.1f} s)  t={time.time() - T0:.0f}s", flush=True)


_SETUP = {}


def kernels(dtype, tag="", only=None):
    """Each engine kernel alone (jitted), the op's own Problem; `only`: these kernels."""
    import jax
    import jax.numpy as jnp

    from fla_jax.ops.common import engine as en
    from fla_jax.ops.gla import pallas_chunk as pc
    if dtype not in _SETUP:
        q, k, v, g, do = inputs(dtype)
        pb = pc.make_problem(q, v, g, None, None, K ** -0.5, pc.GATE_KEY)
        h, _ = jax.jit(lambda k, v, g: en.state_pass_fwd(pb, k, v, g, None, None))(k, v, g)
        _, A = jax.jit(lambda *a: en.output_fwd(pb, *a, None, None, save_scores=True))(q, k, v, g, h)
        dht = jnp.zeros((B, H, K, V), jnp.float32)
        dh, _ = jax.jit(lambda q, do, g: en.state_pass_bwd(pb, q, do, g, dht, None))(q, do, g)
        _SETUP[dtype] = (q, k, v, g, do, pb, h, A, dht, dh)
    q, k, v, g, do, pb, h, A, dht, dh = _SETUP[dtype]
    runs = {
        "state_fwd": (lambda k, v, g: en.state_pass_fwd(pb, k, v, g, None, None), (k, v, g)),
        "output_fwd": (lambda *a: en.output_fwd(pb, *a, None, None), (q, k, v, g, h)),
        "output_fwd+A": (lambda *a: en.output_fwd(pb, *a, None, None, save_scores=True),
                         (q, k, v, g, h)),
        "state_bwd": (lambda q, do, g: en.state_pass_bwd(pb, q, do, g, dht, None), (q, do, g)),
        "output_bwd": (lambda *a: en.output_bwd(pb, *a, None, None), (q, k, v, g, h, A, do, dh)),
    }
    line = []
    for name, (fn, args) in runs.items():
        if only and name not in only:
            continue
        jf = jax.jit(fn)
        t, _ = ms(lambda: jf(*args))
        line.append(f"{name} {t:.3f}")
    print(f"KERNELS {tag} {dtype}: " + "  ".join(line) + f"  t={time.time() - T0:.0f}s", flush=True)


# name -> ({kernel: Launch fields}, timed kernels); most telling first
VARIANTS = {
    "dqk_k64_w8": ({"output_dqk": (64, None, 8, 2)}, ("output_bwd",)),
    "fwd_k16_w4_s2": ({"output_fwd": (16, 128, 4, 2)}, ("output_fwd",)),
    "state_32x32_w4": ({"state_fwd": (32, 32, 4, 2), "state_bwd": (32, 32, 4, 2)},
                       ("state_fwd", "state_bwd")),
    "dv_v64_w8": ({"output_dv": (None, 64, 8, 2)}, ("output_bwd",)),
    "fwd_k32_w4_s1": ({"output_fwd": (32, 128, 4, 1)}, ("output_fwd",)),
    "fwd_k64_w8_s1": ({"output_fwd": (64, 128, 8, 1)}, ("output_fwd",)),
    "state_64x64_w8": ({"state_fwd": (64, 64, 8, 2), "state_bwd": (64, 64, 8, 2)},
                       ("state_fwd", "state_bwd")),
    "dqk_k32_w4": ({"output_dqk": (32, None, 4, 2)}, ("output_bwd",)),
    "fwd_k32_w8_s2": ({"output_fwd": (32, 128, 8, 2)}, ("output_fwd",)),
    "state_64x64_w4_s3": ({"state_fwd": (64, 64, 4, 3), "state_bwd": (64, 64, 4, 3)},
                          ("state_fwd", "state_bwd")),
}


def fla(dtype):
    import torch
    import triton
    from fla.ops.gla import chunk_gla
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    q = torch.randn(B, T, H, K, device="cuda", dtype=dt).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dt).requires_grad_()
    v = torch.randn(B, T, H, V, device="cuda", dtype=dt).requires_grad_()
    g = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).requires_grad_()
    do = torch.randn(B, T, H, V, device="cuda", dtype=dt)

    def fwd():
        with torch.no_grad():
            return chunk_gla(q, k, v, g)[0]

    def fb():
        chunk_gla(q, k, v, g)[0].backward(do)
    a = triton.testing.do_bench(fwd, warmup=25, rep=200, return_mode="median")
    b = triton.testing.do_bench(fb, warmup=25, rep=200, grad_to_none=[q, k, v, g], return_mode="median")
    print(f"OP FLA chunk_gla {dtype}: fwd {a:.3f} ms  fwd+bwd {b:.3f} ms  t={time.time() - T0:.0f}s",
          flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["bf16"])
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--variants", action="store_true")
    p.add_argument("--fla", action="store_true")
    p.add_argument("--tag", default="")
    p.add_argument("--budget", type=float, default=1e9)
    p.add_argument("--small", action="store_true", help="B=1 T=128 H=1 (a CPU smoke run)")
    a = p.parse_args()
    if a.small:
        global B, T, H
        B, T, H = 1, 128, 1
    import jax
    print("devices", jax.devices(), "jax", jax.__version__, flush=True)
    for i, dt in enumerate(a.dtypes):
        whole_op(dt, a.tag)
        if a.fla and i == 0:
            try:
                fla(dt)
            except Exception as e:
                print(f"FLA {dt} unavailable: {type(e).__name__}: {str(e)[:200]}", flush=True)
        if a.kernels and i == 0:
            kernels(dt, a.tag)
    if a.variants:
        from fla_jax.ops.common.engine import launch as L
        for name, (ov, only) in VARIANTS.items():
            if time.time() - T0 > a.budget:
                print("budget reached", flush=True)
                break
            L.OVERRIDES.clear()
            L.OVERRIDES.update({k: L.Launch(*c) for k, c in ov.items()})
            try:
                kernels("bf16", name, only)
            except Exception as e:      # a variant that fails to compile: report, go on
                print(f"KERNELS {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        L.OVERRIDES.clear()
    if a.fla:
        for dt in a.dtypes[1:]:
            try:
                fla(dt)
            except Exception as e:
                print(f"FLA {dt} unavailable: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
