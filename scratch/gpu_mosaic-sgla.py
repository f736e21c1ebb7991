"""GPU check of chunk_simple_gla impl='mosaic' (run from the repo root, PYTHONPATH=root).

Prints PASS|FAIL lines: parity vs the float64 recurrence (small shapes, bf16/fp16, h0 + final
state, g / g_gamma, varlen, T not a multiple of 64) for every backward variant, parity vs
impl='pallas' at B4 T4096 H16 K=V=128, then timings (median ms) of mosaic / pallas / jla.
"""
import os
import statistics
import sys
import threading
import time
import traceback

T_START = time.time()
sys.path.insert(0, os.getcwd())

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax.ops.simple_gla import chunk_simple_gla, mosaic_chunk, mosaic_split
from parity_tests.test_pallas_simple_gla import recurrence64, rel

DT = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
TOL = {"bf16": 1.5e-2, "fp16": 3e-3}
BUDGET_S = 110
WATCHDOG_S = 117    # a hung kernel ends the script here (everything before is printed)


def say(line):
    print(line, flush=True)


def err_text(e):
    return "".join(traceback.format_exception(e))[-3000:]


def inputs(B, T, H, K, V, dtype, use_g, use_gamma, use_h0, cu, seed=0):
    rng = np.random.default_rng(seed)
    dt = DT[dtype]
    rnd = lambda *s: rng.standard_normal(s)  # noqa: E731
    q, k, v, do = rnd(B, T, H, K), rnd(B, T, H, K) / np.sqrt(K), rnd(B, T, H, V), rnd(B, T, H, V)
    q, k, v, do = (np.asarray(jnp.asarray(x, jnp.float32).astype(dt).astype(jnp.float32),
                              np.float64) for x in (q, k, v, do))
    g = np.log(rng.uniform(0.85, 0.999, (B, T, H))).astype(np.float32) if use_g else None
    gamma = np.log(1 - 2.0 ** (-5 - np.arange(H))).astype(np.float32) if use_gamma else None
    N = B if cu is None else len(cu) - 1
    h0 = rnd(N, H, K, V).astype(np.float32) if use_h0 else None
    dht = rnd(N, H, K, V).astype(np.float32)
    return q, k, v, do, g, gamma, h0, dht


def run(impl, dtype, q, k, v, do, g, gamma, h0, dht, cu, grads=True):
    dt = DT[dtype]
    cu_j = None if cu is None else jnp.asarray(cu, jnp.int32)
    gam = None if gamma is None else jnp.asarray(gamma)

    def prim(q, k, v, g, h0):
        return chunk_simple_gla(q, k, v, g=g, g_gamma=gam, initial_state=h0,
                                output_final_state=True, cu_seqlens=cu_j, impl=impl)

    @jax.jit
    def f(q, k, v, g, h0, do, dht):
        if not grads:
            return prim(q, k, v, g, h0) + ((None,) * 5,)
        (o, ht), vjp = jax.vjp(prim, q, k, v, g, h0)
        return o, ht, vjp((do, dht))

    args = [jnp.asarray(x, jnp.float32).astype(dt) for x in (q, k, v)]
    args += [None if g is None else jnp.asarray(g), None if h0 is None else jnp.asarray(h0),
             jnp.asarray(do, jnp.float32).astype(dt), jnp.asarray(dht)]
    t0 = time.time()
    o, ht, (dq, dk, dv, dg, dh0) = jax.block_until_ready(f(*args))
    first = time.time() - t0
    out = {"o": o, "ht": ht, "dq": dq, "dk": dk, "dv": dv, "dg": dg, "dh0": dh0}
    return {n: np.asarray(jnp.asarray(x, jnp.float32), np.float64) for n, x in out.items()
            if x is not None}, first


def where_bad(name, got, ref):
    """Where the error of a failing tensor sits: time row (and its place in a chunk), head."""
    d = np.abs(got - ref)
    idx = np.unravel_index(np.argmax(d), d.shape)
    line = f"  {name}: max|err| {d.max():.3e} at {idx} (|ref| max {np.abs(ref).max():.3e})"
    if d.ndim == 4:       # [B, T, H, D]: error per time row, summed over the rest
        per_t = d.sum(axis=(0, 2, 3))
        bad_t = np.nonzero(per_t > 10 * np.median(per_t) + 1e-12)[0]
        line += f"; rows with large error: {bad_t[:16].tolist()} (of {len(bad_t)})"
        per_d = d.sum(axis=(0, 1, 2))
        line += f"; cols with large error: {np.nonzero(per_d > 10 * np.median(per_d) + 1e-12)[0][:16].tolist()}"
    return line


CASES = {   # most telling first (a time budget cuts the tail)
    "B2T300H4K128_g_h0": dict(B=2, T=300, H=4, K=128, V=128, use_g=True, use_gamma=False,
                              use_h0=True, cu=None),
    "varlen_K128_g_gamma": dict(B=1, T=600, H=4, K=128, V=128, use_g=True, use_gamma=True,
                                use_h0=True, cu=[0, 7, 7, 200, 263, 600]),
    "split_B1T1000H2K64_g_h0": dict(B=1, T=1000, H=2, K=64, V=64, use_g=True,
                                    use_gamma=False, use_h0=True, cu=None,
                                    policy={"min_piece_chunks": 2}),
    "B2T300H4K64_g_h0": dict(B=2, T=300, H=4, K=64, V=64, use_g=True, use_gamma=False,
                             use_h0=True, cu=None),
    "B1T256H2K256_gamma": dict(B=1, T=256, H=2, K=256, V=256, use_g=False, use_gamma=True,
                               use_h0=True, cu=None),
    "B2T128H2K64_nogate_noh0": dict(B=2, T=128, H=2, K=64, V=64, use_g=False,
                                    use_gamma=False, use_h0=False, cu=None),
}


def check(label, got, ref, dtype, first):
    errs = {n: rel(got[n], ref[n]) for n in got}
    tol = TOL[dtype]
    bad = [n for n, e in errs.items() if not e <= (3 * tol if n == "dg" else tol)]
    nums = " ".join(f"{n}={e:.2e}" for n, e in errs.items())
    say(f"{'FAIL' if bad else 'PASS'} {label} {nums} (first call {first:.1f}s)")
    for n in bad:
        say(where_bad(n, got[n], ref[n]))


def ws_times():
    """The warp-specialized forward (last: a hang there loses nothing else)."""
    from fla_jax.ops.simple_gla import mosaic_fwd, mosaic_fwd_ws
    if time.time() - T_START > BUDGET_S:
        say("SKIP ws timing: time budget")
        return
    q, k, v, g, do = big_inputs("bf16")
    g2 = jnp.swapaxes(jnp.cumsum(g.reshape(4, 64, 64, 16), 2).reshape(4, 4096, 16), 1, 2)
    g2 = g2 * 1.4426950408889634
    try:
        f = jax.jit(lambda: mosaic_fwd_ws.forward_ws(q, k, v, g2, None, None, scale=0.088,
                                                     n_seqs=4)[0])
        t, first = timeit(f)
        say(f"TIME kernel forward_ws(output) bf16 {t:.3f} ms (first {first:.1f}s)")
        mosaic_fwd.TUNING["ws"] = True
        fm, _ = ours("mosaic", q, k, v, g, do)
        tf, ff = timeit(fm)
        say(f"TIME mosaic(ws forward) bf16 fwd {tf:.3f} ms (first {ff:.1f}s)")
    except Exception as e:  # noqa: BLE001
        say(f"FAIL ws timing exception:\n{err_text(e)}")
    finally:
        mosaic_fwd.TUNING["ws"] = False


def variant_parity():
    """Forward variants (TUNING of mosaic_fwd: overlap, ws) vs float64 on the first case and
    the varlen case."""
    from fla_jax.ops.simple_gla import mosaic_fwd
    for variant, n_cases in (("overlap", 1), ("ws", 2)):
        for name, c in list(CASES.items())[:n_cases]:
            if time.time() - T_START > BUDGET_S * 0.75:
                say(f"SKIP forward {variant}=True {name}: time budget")
                continue
            mosaic_fwd.TUNING[variant] = True
            try:
                for dtype in ("bf16", "fp16"):
                    x = inputs(c["B"], c["T"], c["H"], c["K"], c["V"], dtype, c["use_g"],
                               c["use_gamma"], c["use_h0"], c["cu"])
                    q, k, v, do, g, gamma, h0, dht = x
                    ref = recurrence64(q, k, v, g, gamma, c["K"] ** -0.5, h0, c["cu"], do, dht)
                    got, first = run("mosaic", dtype, *x, c["cu"], grads=False)
                    check(f"vs-fp64 {name} {dtype} forward {variant}=True", got, ref, dtype,
                          first)
            except Exception as e:  # noqa: BLE001
                say(f"FAIL forward {variant}=True {name} exception:\n{err_text(e)}")
            finally:
                mosaic_fwd.TUNING[variant] = False


def parity_small():
    for i, (name, c) in enumerate(CASES.items()):
        saved = dict(mosaic_split.POLICY)
        mosaic_split.POLICY.update(c.get("policy", {}))
        for dtype in ("bf16", "fp16"):
            if time.time() - T_START > BUDGET_S * 0.3:
                say(f"SKIP vs-fp64 {name} {dtype}: time budget")
                continue
            x = inputs(c["B"], c["T"], c["H"], c["K"], c["V"], dtype, c["use_g"],
                       c["use_gamma"], c["use_h0"], c["cu"])
            q, k, v, do, g, gamma, h0, dht = x
            ref = recurrence64(q, k, v, g, gamma, c["K"] ** -0.5, h0, c["cu"], do, dht)
            try:
                got, first = run("mosaic", dtype, *x, c["cu"], grads=False)
                check(f"vs-fp64 {name} {dtype} forward", got, ref, dtype, first)
            except Exception as e:  # noqa: BLE001
                say(f"FAIL vs-fp64 {name} {dtype} forward exception:\n{err_text(e)}")
                continue
            # the Pallas backward as a control on the first case only
            for backward in ("pallas", "mosaic") if i == 0 else ("mosaic",):
                mosaic_chunk.BACKWARD = backward
                try:
                    got, first = run("mosaic", dtype, *x, c["cu"])
                    check(f"vs-fp64 {name} {dtype} bwd={backward}", got, ref, dtype, first)
                except Exception as e:  # noqa: BLE001
                    say(f"FAIL vs-fp64 {name} {dtype} bwd={backward} exception:\n{err_text(e)}")
        mosaic_split.POLICY.clear()
        mosaic_split.POLICY.update(saved)
    mosaic_chunk.BACKWARD = "pallas"


def big_inputs(dtype, B=4, T=4096, H=16, K=128, V=128, seed=1):
    rng = np.random.default_rng(seed)
    dt = DT[dtype]
    q = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32).astype(dt)
    k = jnp.asarray(rng.standard_normal((B, T, H, K)) / np.sqrt(K), jnp.float32).astype(dt)
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32).astype(dt)
    do = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32).astype(dt)
    g = jnp.asarray(-rng.uniform(0.01, 0.2, (B, T, H)), jnp.float32)
    return q, k, v, g, do


def ours(impl, q, k, v, g, do):
    def f(q, k, v, g):
        return chunk_simple_gla(q, k, v, g=g, impl=impl)[0]
    fwd = jax.jit(f)
    fb = jax.jit(lambda *p: jax.vjp(f, *p)[1](do))
    return (lambda: fwd(q, k, v, g)), (lambda: fb(q, k, v, g))


def jla_fns(q, k, v, g, do):
    from jla.ops import linear_attention

    def f(q, k, v, g):
        return linear_attention("simple_gla", q, k, v, impl="mosaic_gpu", g=g)[0]
    fwd = jax.jit(f)
    fb = jax.jit(lambda *p: jax.vjp(f, *p)[1](do))
    return (lambda: fwd(q, k, v, g)), (lambda: fb(q, k, v, g))


def timeit(fn, samples=21, inner=10):
    t0 = time.time()
    jax.block_until_ready(fn())
    first = time.time() - t0
    for _ in range(3):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(ts), first


def parity_big_and_timings(dtypes=("bf16", "fp16")):
    """B4 T4096 H16 K=V=128: timings of mosaic / pallas / jla, mosaic vs pallas outputs."""
    from fla_jax.ops.simple_gla import mosaic_fwd
    entries = (("mosaic", "pallas"), ("mosaic", "mosaic"), ("pallas", None), ("jla", None))
    for dtype in dtypes:
        q, k, v, g, do = big_inputs(dtype)
        res, outs = {}, {}
        for impl, backward in entries:
            label = impl if backward is None else f"mosaic(bwd={backward})"
            if backward == "ws":
                label = "mosaic(ws forward)"
            if time.time() - T_START > BUDGET_S:
                say(f"SKIP time {label} {dtype}: time budget")
                continue
            if dtype == "fp16" and impl == "pallas":
                continue
            try:
                if backward == "ws":
                    mosaic_fwd.TUNING["ws"] = True
                elif backward is not None:
                    mosaic_chunk.BACKWARD = backward
                f, fb = jla_fns(q, k, v, g, do) if impl == "jla" else ours(impl, q, k, v, g, do)
                tf, ff = timeit(f)
                tb, fbf = timeit(fb)
                res[label] = (tf, tb)
                say(f"TIME {label} {dtype} fwd {tf:.3f} ms fwd+bwd {tb:.3f} ms "
                    f"(first calls {ff:.1f}s / {fbf:.1f}s)")
                if label in ("mosaic(bwd=pallas)", "mosaic(bwd=mosaic)", "pallas"):
                    outs[label] = [np.asarray(jnp.asarray(x, jnp.float32), np.float64)
                                   for x in (f(),) + tuple(fb())]
            except Exception as e:  # noqa: BLE001
                say(f"FAIL time {label} {dtype} exception:\n{err_text(e)}")
            finally:
                mosaic_chunk.BACKWARD = "pallas"
                mosaic_fwd.TUNING["ws"] = False
        for label in ("mosaic(bwd=pallas)", "mosaic(bwd=mosaic)"):
            if label not in outs or "pallas" not in outs:
                continue
            errs = [rel(a, b) for a, b in zip(outs[label], outs["pallas"])]
            tol = 2 * TOL[dtype]
            ok = all(e <= (3 * tol if i == 4 else tol) for i, e in enumerate(errs))
            names = ("o", "dq", "dk", "dv", "dg")
            say(f"{'PASS' if ok else 'FAIL'} {label}-vs-pallas B4T4096H16K128 {dtype} "
                + " ".join(f"{n}={e:.2e}" for n, e in zip(names, errs)))
        if "jla" in res:
            for name, (tf, tb) in res.items():
                if name.startswith("mosaic"):
                    say(f"RATIO {name} / jla {dtype}: fwd {tf / res['jla'][0]:.2f}x "
                        f"fwd+bwd {tb / res['jla'][1]:.2f}x")


def long_sequence_times():
    """B1 T32768 H16 K=V=128 bf16: mosaic with and without the sequence split, and jla."""
    q, k, v, g, do = big_inputs("bf16", B=1, T=32768)
    saved = dict(mosaic_split.POLICY)
    for label, policy in (("split", {}), ("no-split", {"max_ctas": 0})):
        if time.time() - T_START > BUDGET_S:
            say(f"SKIP long {label}: time budget")
            continue
        mosaic_split.POLICY.update(policy)
        try:
            f, fb = ours("mosaic", q, k, v, g, do)
            tf, ff = timeit(f, samples=11, inner=5)
            tb, _ = timeit(fb, samples=11, inner=5)
            say(f"TIME mosaic {label} B1T32768 bf16 fwd {tf:.3f} ms fwd+bwd {tb:.3f} ms "
                f"(first {ff:.1f}s)")
        except Exception as e:  # noqa: BLE001
            say(f"FAIL long {label} exception:\n{err_text(e)}")
        mosaic_split.POLICY.clear()
        mosaic_split.POLICY.update(saved)
    try:
        if time.time() - T_START < BUDGET_S:
            f, fb = jla_fns(q, k, v, g, do)
            tf, ff = timeit(f, samples=11, inner=5)
            tb, _ = timeit(fb, samples=11, inner=5)
            say(f"TIME jla B1T32768 bf16 fwd {tf:.3f} ms fwd+bwd {tb:.3f} ms (first {ff:.1f}s)")
    except Exception as e:  # noqa: BLE001
        say(f"FAIL long jla exception:\n{err_text(e)}")


def kernel_only_time():
    """Where the time goes (B4 T4096 H16 K=V=128 bf16): each Mosaic kernel alone."""
    from fla_jax.ops.simple_gla import mosaic_bwd_kernels as mbk
    from fla_jax.ops.simple_gla import mosaic_fwd
    q, k, v, g, do = big_inputs("bf16")
    g2 = jnp.swapaxes(jnp.cumsum(g.reshape(4, 64, 64, 16), 2).reshape(4, 4096, 16), 1, 2)
    g2 = g2 * 1.4426950408889634
    kw = dict(scale=0.088, n_seqs=4)
    parts = {
        "forward(output)": lambda: mosaic_fwd.forward(q, k, v, g2, None, None, out_final=False,
                                                      **kw)[0],
        "forward(states)": lambda: mosaic_fwd.forward(q, k, v, g2, None, None, out_final=False,
                                                      mode="states", **kw)[0],
        "dstate": lambda: mbk.dstate(q, do, g2, jnp.zeros((4, 16, 128, 128), jnp.float32),
                                     None, want_dh0=False, **kw)[0],
    }
    for name, fn in parts.items():
        for overlap in ((False, True) if name == "forward(output)" else (False,)):
            mosaic_fwd.TUNING["overlap"] = overlap
            try:
                f = jax.jit(fn)
                t, first = timeit(f)
                say(f"TIME kernel {name} overlap={overlap} bf16 {t:.3f} ms (first {first:.1f}s)")
            except Exception as e:  # noqa: BLE001
                say(f"FAIL kernel {name} overlap={overlap} exception:\n{err_text(e)}")
    mosaic_fwd.TUNING["overlap"] = False
    try:
        hs = jax.jit(parts["forward(states)"])()
        f = jax.jit(lambda hs: mbk.grads(q, k, v, do, g2, hs, hs, scale=0.088))
        t, first = timeit(lambda: f(hs))
        say(f"TIME kernel grads bf16 {t:.3f} ms (first {first:.1f}s)")
    except Exception as e:  # noqa: BLE001
        say(f"FAIL kernel grads exception:\n{err_text(e)}")


if __name__ == "__main__":
    say(f"env jax {jax.__version__} devices {jax.devices()}")
    steps = (parity_small, kernel_only_time, lambda: parity_big_and_timings(("bf16",)),
             long_sequence_times, lambda: parity_big_and_timings(("fp16",)), variant_parity,
             ws_times)
    if os.environ.get("MOSAIC_DRY"):   # CPU check of this script: GPU interpreter, tiny shapes
        WATCHDOG_S = 10 ** 6
        from fla_jax.ops.common.mosaic.tiles import gpu_interpret
        CASES = {"dry": dict(B=1, T=70, H=1, K=64, V=64, use_g=True, use_gamma=True,
                             use_h0=True, cu=[0, 20, 70]),
                 "dry_split": dict(B=1, T=300, H=1, K=64, V=64, use_g=True, use_gamma=False,
                                   use_h0=True, cu=None, policy={"min_piece_chunks": 2})}
        steps = (parity_small, variant_parity)
        ctx = gpu_interpret()
        ctx.__enter__()
    watchdog = threading.Timer(WATCHDOG_S - (time.time() - T_START),
                               lambda: (say(f"TIMEOUT after {WATCHDOG_S}s: exiting"),
                                        os._exit(3)))
    watchdog.daemon = True
    watchdog.start()
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001
            say(f"FAIL {getattr(step, '__name__', 'step')} exception:\n{err_text(e)}")
    say(f"done in {time.time() - T_START:.1f}s")
