"""What the T0 kernel's merge (mosaic_kkt.MERGE / SUBST_BLOCK) does to the delta family's
outputs: chunk_gated_delta_rule impl="mosaic" interpreted on the CPU (JAX's GPU interpret mode;
the lane-level solve by XLA, exact like the GPU's), o and the final state against the float64
oracle (fla_torch's token-by-token reference; needs torch), relative RMS error, for keys nearly
parallel within each chunk (where T0's errors are largest: mosaic_t0_check.py) and random keys.
RESULTS.md run 24 is this run.

    PYTHONPATH=. python benchmarks/mosaic_t0_e2e.py --dtype fp16 --seeds 0 1 2 \\
        --variant hilo:32 --variant fp16:16
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("NPROC", "8")     # the interpreter's warpgroup threads (conftest.py)

import numpy as np


def recurrence(q, k, v, g, beta, scale):
    """The project's float64 oracle (fla_torch's token-by-token reference): o [B, T, H, V],
    final states [B, H, K, V]."""
    import torch
    from fla_torch.ops.gated_delta_rule.reference import gated_delta_rule_reference
    t = [torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v, g, beta)]
    o, ht = gated_delta_rule_reference(*t, scale=scale, output_final_state=True)
    return o.numpy(), ht.numpy()


def inputs(rng, kind, T, H, K):
    """float64 q, k (unit rows; 'near_parallel': one shared direction per chunk of 64 plus 0.15
    noise), v, g in -(0, 0.1), beta in (0.05, 1.95)."""
    k = rng.standard_normal((1, T, H, K))
    if kind == "near_parallel":
        k = k * 0.15 + rng.standard_normal((1, T // 64, 1, H, K)).repeat(64, 2).reshape(k.shape)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return (rng.standard_normal((1, T, H, K)), k, rng.standard_normal((1, T, H, K)),
            -rng.uniform(0.0, 0.1, (1, T, H)), rng.uniform(0.05, 1.95, (1, T, H)))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="fp16", choices=["bf16", "fp16"])
    p.add_argument("--variant", action="append", default=[],
                   help="MERGE:SUBST_BLOCK (default: hilo:32 fp16:16)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--T", type=int, default=256)
    p.add_argument("--H", type=int, default=2)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from fla_jax.ops.common.mosaic.tiles import gpu_interpret
    from fla_jax.ops.gated_delta_rule import chunk_gated_delta_rule, mosaic_kkt
    dt = {"fp16": jnp.float16, "bf16": jnp.bfloat16}[args.dtype]
    K = 128

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))

    saved = mosaic_kkt.MERGE, mosaic_kkt.SUBST_BLOCK
    for seed in args.seeds:
        rng = np.random.default_rng(seed)
        for kind in ("near_parallel", "random"):
            q, k, v, g, beta = inputs(rng, kind, args.T, args.H, K)
            acts = [jnp.asarray(x, dt) for x in (q, k, v)]
            exact = [np.asarray(x.astype(jnp.float32), np.float64) for x in acts]
            gj, bj = jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32)
            o_ref, h_ref = recurrence(*exact, np.asarray(gj, np.float64),
                                      np.asarray(bj, np.float64), K ** -0.5)
            floor = rel(np.asarray(jnp.asarray(o_ref, jnp.float32).astype(dt), np.float64),
                        o_ref)
            print(f"seed {seed} {kind} {args.dtype}: o's rounding {floor:.3e}", flush=True)
            for spec in args.variant or ["hilo:32", "fp16:16"]:
                merge, block = spec.split(":")
                mosaic_kkt.MERGE, mosaic_kkt.SUBST_BLOCK = merge, int(block)
                jax.clear_caches()
                t = time.time()
                with gpu_interpret():
                    o, h = chunk_gated_delta_rule(*acts, gj, bj, output_final_state=True,
                                                  impl="mosaic")
                print(f"  {spec:8s} o {rel(o.astype(jnp.float32), o_ref):.3e}  ht "
                      f"{rel(h, h_ref):.3e}  ({time.time() - t:.0f} s)", flush=True)
    mosaic_kkt.MERGE, mosaic_kkt.SUBST_BLOCK = saved


if __name__ == "__main__":
    main()
