"""Device time of the delta family's gate-vector glue (XLA, before the Mosaic kernels): G (the
chunk-local cumsum of g), G_last - G and beta^T, all [HV, R] fp32, in five forms (RESULTS.md run
24 call 3: v0 was the default, v3 is mosaic_layout.gate_vectors with LATER="difference").
GPU; on CPU it runs too (host-thread times).

    PYTHONPATH=. python benchmarks/mosaic_gate_glue.py
"""
import sys, time
sys.path[:0] = ["benchmarks", "."]
import jax, jax.numpy as jnp, numpy as np
C, L2E = 64, 1.4426950408889634

def v0(g, b):          # transposed, cumsum, reversed cumsum for G_last - G (LATER="sum")
    R, HV = g.shape
    gt = g.T.reshape(HV, R // C, C)
    G = jnp.cumsum(gt, axis=-1)
    later = jnp.cumsum(gt[..., ::-1], axis=-1)[..., ::-1] - gt
    return (G * L2E).reshape(HV, R), (later * L2E).reshape(HV, R), b.T

def v1(g, b):          # cumsum in the natural layout, later = G_last - G, then transposes
    R, HV = g.shape
    gc = g.reshape(R // C, C, HV)
    G = jnp.cumsum(gc, axis=1)
    later = G[:, -1:] - G
    return (G * L2E).reshape(R, HV).T, (later * L2E).reshape(R, HV).T, b.T

def v2(g, b):          # one stacked transpose of (G, later, beta)
    R, HV = g.shape
    gc = g.reshape(R // C, C, HV)
    G = jnp.cumsum(gc, axis=1)
    later = G[:, -1:] - G
    st = jnp.stack([(G * L2E).reshape(R, HV), (later * L2E).reshape(R, HV), b])   # [3, R, HV]
    t = jnp.swapaxes(st, 1, 2)
    return t[0], t[1], t[2]

def v3(g, b):          # transposed first, then cumsum, later = G_last - G
    R, HV = g.shape
    gt = g.T.reshape(HV, R // C, C)
    G = jnp.cumsum(gt, axis=-1)
    later = G[..., -1:] - G
    return (G * L2E).reshape(HV, R), (later * L2E).reshape(HV, R), b.T

def v4(g, b):          # cumsum as a log-step (Hillis-Steele) scan of shifted adds, natural layout
    R, HV = g.shape
    G = g.reshape(R // C, C, HV)
    s = 1
    while s < C:
        G = G + jnp.pad(G[:, :-s], ((0, 0), (s, 0), (0, 0)))
        s *= 2
    later = G[:, -1:] - G
    return (G * L2E).reshape(R, HV).T, (later * L2E).reshape(R, HV).T, b.T

rng = np.random.default_rng(0)
for R in (16384, 32768):
    g = jnp.asarray(-rng.uniform(0.01, 0.2, (R, 16)), jnp.float32)
    b = jnp.asarray(rng.uniform(0.05, 0.95, (R, 16)), jnp.float32)
    ref = [np.asarray(x) for x in jax.jit(v0)(g, b)]
    for name, f in (("v0", v0), ("v1", v1), ("v2", v2), ("v3", v3), ("v4", v4)):
        fj = jax.jit(f)
        out = fj(g, b)
        jax.block_until_ready(out)
        err = max(float(np.max(np.abs(np.asarray(o) - r))) for o, r in zip(out, ref))
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(200):
                out = fj(g, b)
            jax.block_until_ready(out)
            ts.append((time.perf_counter() - t) / 200 * 1e6)
        from kernel_profile import jax_profile
        table, _ = jax_profile(lambda: fj(g, b), 20)
        busy = sum(us for _, us in table.values()) / 20
        n = sum(c for c, _ in table.values()) / 20
        print(f"R {R} {name}: {sorted(ts)[3]:.1f} us/call wall, device {busy:.1f} us in "
              f"{n:.0f} kernels, max |diff| {err:.2e}", flush=True)
