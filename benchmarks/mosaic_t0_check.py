"""The delta family's T0 kernel (mosaic_kkt.py, T0 only) on a Hopper GPU against float64: every
inverse (doubling; substitution with SUBST_BLOCK 64 / 32 / 16) in bf16 and fp16, unit keys
random or nearly parallel within a chunk, beta in (0.05, 1.95); relative RMS error per row
(RESULTS.md run 19, call 5). The CPU tests interpret the kernel with XLA in place of the
lane-level solve; this is what runs the solve itself.

    PYTHONPATH=. python benchmarks/mosaic_t0_check.py
"""
import numpy as np, jax, jax.numpy as jnp
from fla_jax.ops.gated_delta_rule import mosaic_kkt
from fla_jax.ops.gated_delta_rule.mosaic_kkt import C, gate_free_inverse_mosaic
rng = np.random.default_rng(0)
R, H, K = 64 * 64, 2, 128
def ref(k, beta):
    out = np.zeros((H, R, C))
    for n in range(R // C):
        rows = slice(n * C, (n + 1) * C)
        for h in range(H):
            kc = k[rows, h]; a = np.tril(beta[rows, h][:, None] * (kc @ kc.T), -1)
            out[h, rows] = np.linalg.inv(np.eye(C) + a)
    return out
for name in ("random", "near_parallel"):
    k = rng.standard_normal((R, H, K))
    if name == "near_parallel":
        k = k * 0.15 + rng.standard_normal((R // C, 1, H, K)).repeat(C, 0).reshape(R, H, K)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0.05, 1.95, (R, H))
    kb = jnp.asarray(k, jnp.bfloat16)
    want = ref(np.asarray(kb.astype(jnp.float32), np.float64), beta)
    for inv, blk in (("doubling", 64), ("substitution", 64), ("substitution", 32), ("substitution", 16)):
        mosaic_kkt.INVERSE, mosaic_kkt.SUBST_BLOCK = inv, blk
        jax.clear_caches()
        for dt in (jnp.bfloat16, jnp.float16):
            (t0,) = gate_free_inverse_mosaic(kb.astype(dt), jnp.asarray(beta.T, jnp.float32), 1, dt)
            got = np.asarray(t0.astype(jnp.float32), np.float64)
            err = np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2))
            print(f"{name:14s} {inv:12s} {blk:3d} {jnp.dtype(dt).name:9s} rel rms {err:.2e} finite {np.isfinite(got).all()}", flush=True)
mosaic_kkt.INVERSE, mosaic_kkt.SUBST_BLOCK = "substitution", 32
