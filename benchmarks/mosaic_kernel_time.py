"""Kernel-only timings of the delta family's two forward kernels against jax-linear-attention's
on inputs of one shape (GPU): our T0 kernel (mosaic_kkt.gate_free_inverse_mosaic, T0 only) vs
jla's `kkt_fwd`, our warp-specialized forward (mosaic_fwd_ws.fused_forward_ws) vs jla's
`fused_fwd_wy` (output_final_state off, as run.py calls it; on, too). Each kernel is jitted
alone and timed by run.py's time_jax (wall clock around block_until_ready, median of 15 loops
of 20 calls: launches overlap, so this is close to device time). Variants override module constants
(pallas_launch_sweep.py's `<module>:NAME=value` syntax) for our kernels, one line each;
RESULTS.md run 22 call 4 is this measurement (then a scratch script).

    PYTHONPATH=. python benchmarks/mosaic_kernel_time.py \\
        --variant "fla_jax.ops.gated_delta_rule.mosaic_kkt:SUBST_BLOCK=16"
    PYTHONPATH=. python benchmarks/mosaic_kernel_time.py --dry-run   # CPU: tiny, interpreted
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
C = 64


def inputs(B, T, H, K, V, seed=0, dtype="bf16"):
    """q, k (unit rows), v: [B * T, H, .] in dtype (bf16 / fp16); beta, G (chunk-local log2
    cumsum), G_last - G: [H, B * T] fp32; the sequence table [B, 32] int32 (batch rows as
    sequences)."""
    import numpy as np
    import jax.numpy as jnp
    rng = np.random.default_rng(seed)
    R, bf = B * T, {"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype]
    q = jnp.asarray(rng.standard_normal((R, H, K)) * K ** -0.5, bf)
    k = rng.standard_normal((R, H, K))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), bf)
    v = jnp.asarray(rng.standard_normal((R, H, V)), bf)
    beta = jnp.asarray(rng.uniform(0.05, 0.95, (H, R)), jnp.float32)
    g = -rng.uniform(0.01, 0.2, (H, R // C, C))
    later = np.cumsum(g[..., ::-1], -1)[..., ::-1] - g
    G = jnp.asarray((np.cumsum(g, -1) * np.log2(np.e)).reshape(H, R), jnp.float32)
    Gs = jnp.asarray((later * np.log2(np.e)).reshape(H, R), jnp.float32)
    table = np.zeros((B, 32), np.int32)
    table[:, 0], table[:, 1] = np.arange(B) * (T // C), T // C
    return q, k, v, beta, G, Gs, jnp.asarray(table)


def timeit(fn, *args, loops=15, inner=20):
    """Median microseconds per call of jit(fn)(*args): run.py's time_jax (a first call and 3
    more, then `loops` of `inner` calls); loops=0 (the CPU dry run): one call, its time."""
    import jax
    from run import time_jax
    f = jax.jit(fn)
    if loops == 0:      # the dry run checks the calls: one each
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        return (time.perf_counter() - t0) * 1e6
    return time_jax(lambda: f(*args), loops=loops, inner=inner)[0] * 1e3


def ours(x, scale, loops, inner):
    """{kernel: us} of our T0 and ws forward kernels (the current module constants)."""
    import jax
    import jax.numpy as jnp
    from fla_jax.ops.gated_delta_rule import mosaic_fwd_ws, mosaic_kkt
    q, k, v, beta, G, Gs, table = x

    def t0_fn(k, b):
        return mosaic_kkt.gate_free_inverse_mosaic(k, b, 1, k.dtype)[0]

    def ws_fn(q, k, v, t, g, gs, b, tab):
        return mosaic_fwd_ws.fused_forward_ws(q, k, v, t, g, gs, b, tab, None, scale=scale)[0]
    t0 = jax.jit(t0_fn)(k, beta)
    return {"T0": timeit(t0_fn, k, beta, loops=loops, inner=inner),
            "ws forward": timeit(ws_fn, q, k, v, t0, G, Gs, beta, table, loops=loops,
                                 inner=inner)}


def jla(x, B, T, H, scale, loops, inner):
    """{kernel: us} of jla's kkt_fwd and fused_fwd_wy on the same values in its layouts."""
    import jax
    import jax.numpy as jnp
    from jla.ops.mosaic_gpu import gated_delta_rule_kernels as gdr
    from jla.ops.mosaic_gpu import scalar_gate_fused as sf
    q, k, v, beta, G, _, _ = x
    qj, kj, vj = (a.reshape(B, T, H, -1) for a in (q, k, v))
    bt, g2 = (a.reshape(H, B, T).transpose(1, 0, 2) for a in (beta, G))
    tj = jax.jit(gdr.kkt_fwd)(kj, bt)
    out = {"kkt_fwd": timeit(gdr.kkt_fwd, kj, bt, loops=loops, inner=inner)}
    for final in (False, True):
        def fn(q, k, v, t, g, b, final=final):
            return sf.fused_fwd_wy(q, k, v, t, g, b, None, scale=scale, out_final=final,
                                   out_dtype=q.dtype)[0]
        out[f"fused_fwd_wy out_final={final}"] = timeit(fn, qj, kj, vj, tj, g2, bt,
                                                        loops=loops, inner=inner)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--variant", action="append", default=[],
                   help="'<module>:NAME=value[,...]' for our kernels (pallas_launch_sweep.py)")
    p.add_argument("--no-jla", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: a tiny shape, our kernels interpreted, one timing loop")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path[:0] = [HERE, os.path.dirname(HERE)]
    from pallas_launch_sweep import Override, parse_variant
    B, T, H, K, V = (1, 2 * C, 1, 64, 64) if args.dry_run else (4, 4096, 16, 128, 128)
    loops, inner = (0, 1) if args.dry_run else (15, 20)
    x = inputs(B, T, H, K, V, dtype=args.dtype)
    scale = K ** -0.5
    print(f"B{B} T{T} H{H} K{K} V{V} {args.dtype}, us per call", flush=True)
    for spec in [None] + args.variant:
        if args.dry_run:
            from fla_jax.ops.common.mosaic.tiles import gpu_interpret
            ctx = gpu_interpret()
        else:
            import contextlib
            ctx = contextlib.nullcontext()
        with Override(parse_variant(spec) if spec else []), ctx:
            times = ours(x, scale, loops, inner)
        print(f"[{spec or 'default'}] " + ", ".join(f"{n} {t:.1f}" for n, t in times.items()),
              flush=True)
    if not (args.no_jla or args.dry_run):
        try:
            times = jla(x, B, T, H, scale, loops, inner)
            print("[jla] " + ", ".join(f"{n} {t:.1f}" for n, t in times.items()), flush=True)
        except ImportError as e:
            print(f"[jla] not importable: {e}", flush=True)


if __name__ == "__main__":
    main()
