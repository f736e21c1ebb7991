"""GPU checks of chunk_gated_delta_rule / chunk_delta_rule impl='mosaic' (helper mosaic-gdn).

Run from the worktree root with PYTHONPATH=<root>. Prints one PASS|FAIL line per check and
timings; stays under ~120 s. Each block is wrapped so one failure does not hide the rest.
"""
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
T_START = time.perf_counter()

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax.ops.delta_rule import chunk_delta_rule
from fla_jax.ops.gated_delta_rule import chunk_gated_delta_rule, mosaic_chunk

print("devices", jax.devices(), "jax", jax.__version__, flush=True)
DRYRUN = os.environ.get("GDN_DRYRUN") == "1"   # CPU check of this script: interpreter, tiny shapes
if not DRYRUN:   # the run must end by ~120 s whatever hangs
    import threading

    def _watchdog():
        print(f"FAIL watchdog: ended the run at {elapsed():.0f}s", flush=True)
        os._exit(3)
    _timer = threading.Timer(117, _watchdog)
    _timer.daemon = True
    _timer.start()
if DRYRUN:
    from fla_jax.ops.common.mosaic.tiles import gpu_interpret
    _INTERP = gpu_interpret()
    _INTERP.__enter__()
DT = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def elapsed():
    return time.perf_counter() - T_START


def guard(label, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        text = "".join(traceback.format_exception(e))
        print(f"FAIL {label} exception: {text[-3000:]}", flush=True)


def inputs(seed, B, T, H, HV, K, V, N, g_min=-0.2):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T, H, K))
    x = {"q": rng.standard_normal((B, T, H, K)), "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
         "v": rng.standard_normal((B, T, HV, V)),
         "beta": rng.uniform(0.05, 0.95, size=(B, T, HV)),
         "g": rng.uniform(g_min, -0.01, size=(B, T, HV)),
         "h0": rng.standard_normal((N, HV, K, V)) * 0.5,
         "do": rng.standard_normal((B, T, HV, V)), "dht": rng.standard_normal((N, HV, K, V))}
    return x


def call(family, impl, x, dt, cu=None, l2=False, with_h0=True, backward="pallas",
         overlap=True):
    """backward: "pallas", "mosaic" (fp32 chunk-local matmuls) or "mosaic16" (16-bit);
    overlap: mosaic_fwd_kernel.OVERLAP (independent wgmmas issued together)."""
    from fla_jax.ops.gated_delta_rule import mosaic_bwd, mosaic_fwd_kernel
    q, k, v = (jnp.asarray(x[n], dt) for n in ("q", "k", "v"))
    beta = jnp.asarray(x["beta"], jnp.float32)
    g = jnp.asarray(x["g"], jnp.float32)
    h0 = jnp.asarray(x["h0"], jnp.float32) if with_h0 else None
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)

    def f(q, k, v, g, beta, h0):
        mosaic_chunk.BACKWARD = backward[:6]   # read when traced
        mosaic_fwd_kernel.OVERLAP = overlap
        mosaic_bwd.LOCAL_MATMUL = "input" if backward == "mosaic16" else "fp32"
        if family == "gdn":
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                          output_final_state=True, cu_seqlens=cu,
                                          use_qk_l2norm_in_kernel=l2, impl=impl)
        return chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True,
                                cu_seqlens=cu, use_qk_l2norm_in_kernel=l2, impl=impl)
    return f, (q, k, v, g, beta, h0)


def grads(f, args, x, dt):
    (o, ht), vjp = jax.vjp(f, *args)
    do = jnp.asarray(x["do"], o.dtype)
    dht = jnp.asarray(x["dht"], ht.dtype)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    out = {"o": o, "ht": ht}
    for n, gr in zip(names, vjp((do, dht))):
        if gr is not None:
            out[n] = gr
    return out


def to64(d):
    return {n: np.asarray(jnp.asarray(a, jnp.float32), np.float64) for n, a in d.items()}


def rel(a, b):
    """max abs err, relative rms err."""
    err = np.abs(a - b)
    return float(err.max()), float(np.sqrt(np.mean(err ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


# --- parity vs the float64 reference on small shapes -------------------------------------
TOL = {"bf16": 2e-2, "fp16": 5e-3}     # relative rms (parity_tests/cases.py TOLERANCE scale)
try:
    from parity_tests.cases import tolerance
except Exception:  # noqa: BLE001
    tolerance = None


def check_reference(family, dtype, K, cu, l2, label, backward="pallas", overlap=True):
    label = f"{label} bwd={backward} overlap={overlap}"
    B = 1 if cu is not None else 2
    T = 300
    if DRYRUN:
        T, K, cu = 100, 64, (None if cu is None else [0, 17, 17, 70, 100])
    N = B if cu is None else len(cu) - 1
    x = inputs(1, B, T, 4, 4, K, K, N, g_min=-3.0)
    dt = DT[dtype]
    f, args = call(family, "mosaic", x, dt, cu=cu, l2=l2, backward=backward, overlap=overlap)
    t0 = time.perf_counter()
    got = to64(jax.block_until_ready(jax.jit(lambda *a: grads(f, a, x, dt))(*args)))
    first = time.perf_counter() - t0
    # the oracle: the token-serial reference in float64 on the dtype-rounded inputs
    with jax.enable_x64(True):
        xr = dict(x)
        for n in ("q", "k", "v"):
            xr[n] = np.asarray(jnp.asarray(x[n], dt).astype(jnp.float32), np.float64)
        fr, argr = call(family, "reference", xr, jnp.float64, cu=cu, l2=l2)
        argr = tuple(None if a is None else jnp.asarray(a, jnp.float64) for a in argr)
        ref = to64(jax.jit(lambda *a: grads(fr, a, xr, jnp.float64))(*argr))
    bad, worst = [], {}
    for n, r in ref.items():
        if n not in got:
            continue
        mx, rr = rel(got[n], r)
        worst[n] = (round(mx, 5), round(rr, 5))
        tol = tolerance(dtype, n) if tolerance else TOL[dtype]
        if not (np.all(np.isfinite(got[n])) and rr <= tol):
            bad.append(n)
    status = "FAIL" if bad else "PASS"
    print(f"{status} ref {label} first_call_s={first:.1f} bad={bad} (max_abs, rel_rms)={worst}",
          flush=True)


# --- vs impl='pallas' at the benchmark shape, and timings ---------------------------------
def time_fn(fn, reps=20, inner=5):
    """median over reps of the mean of `inner` back-to-back calls (ms), first-call seconds."""
    if DRYRUN:
        reps, inner = 1, 1
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    for _ in range(3):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples), first


def bench(family, dtype, B=4, T=4096, H=16, HV=16, K=128):
    if DRYRUN:
        B, T, H, HV, K = 1, 128, 1, HV // H, 64
    x = inputs(2, B, T, H, HV, K, K, B)
    dt = DT[dtype]
    res = {}
    variants = {"mosaic": ("mosaic", "pallas", True), "mosaic+mbwd": ("mosaic", "mosaic", True),
                "mosaic+mbwd16": ("mosaic", "mosaic16", True),
                "mosaic-nooverlap": ("mosaic", "pallas", False),
                "pallas": ("pallas", "pallas", True)}
    for name, (impl, bw, ov) in variants.items():
        f, args = call(family, impl, x, dt, with_h0=False, backward=bw, overlap=ov)
        f2 = lambda *a, f=f: f(*a[:5], None)  # noqa: E731
        args = args[:5]
        do = jnp.asarray(x["do"], dt)
        fwd = jax.jit(lambda *a, f2=f2: f2(*a)[0])
        fb = jax.jit(lambda *a, f2=f2: jax.vjp(lambda *p: f2(*p)[0], *a)[1](do))
        res[name] = (fwd, fb, args)
    firsts = {}

    def timed_first(key, fn, args):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        firsts[key] = time.perf_counter() - t0
        return out
    o_p = np.asarray(timed_first("pallas fwd", *res["pallas"][::2]).astype(jnp.float32))
    for name in ("mosaic", "mosaic-nooverlap"):
        o_m = np.asarray(timed_first(f"{name} fwd", *res[name][::2]).astype(jnp.float32))
        mx, rr = rel(o_m, o_p)
        ok = np.all(np.isfinite(o_m)) and rr <= (TOL[dtype] * 2)
        print(f"{'PASS' if ok else 'FAIL'} vs-pallas {name} {family} {dtype} B{B} T{T} H{H} "
              f"HV{HV} K=V={K} o max_abs={mx:.4g} rel_rms={rr:.4g}", flush=True)
    gp = timed_first("pallas fwd+bwd", *res["pallas"][1:])
    for name in ("mosaic", "mosaic+mbwd", "mosaic+mbwd16"):
        gm = timed_first(f"{name} fwd+bwd", *res[name][1:])
        errs = {}
        for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), gm, gp):
            if a is None or (family == "delta" and n == "dg"):
                continue
            a64 = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
            b64 = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
            errs[n] = (round(rel(a64, b64)[1], 5), bool(np.all(np.isfinite(a64))))
        ok = all(fin and e <= TOL[dtype] * 2 for e, fin in errs.values())
        print(f"{'PASS' if ok else 'FAIL'} grads-vs-pallas {name} {family} {dtype} B{B} T{T} "
              f"H{H} HV{HV} K=V={K} (rel_rms, finite)={errs}", flush=True)
    line = []
    for name in ("mosaic", "mosaic-nooverlap", "mosaic+mbwd", "mosaic+mbwd16", "pallas"):
        fwd, fb, args = res[name]
        if name == "mosaic-nooverlap":
            ms, first = time_fn(lambda: fwd(*args))
            line.append(f"{name} fwd {ms:.3f} ms (first {first:.1f}s)")
            continue
        if name.startswith("mosaic+"):
            msb, firstb = time_fn(lambda: fb(*args))
            line.append(f"{name} fwd+bwd {msb:.3f} ms (first {firstb:.1f}s)")
            continue
        ms, first = time_fn(lambda: fwd(*args))
        msb, firstb = time_fn(lambda: fb(*args))
        line.append(f"{name} fwd {ms:.3f} ms (first {first:.1f}s) fwd+bwd {msb:.3f} ms "
                    f"(first {firstb:.1f}s)")
    try:
        from jla.ops import linear_attention
        kind = "gated_deltanet" if family == "gdn" else "deltanet"
        q, k, v = (jnp.asarray(x[n], dt) for n in ("q", "k", "v"))
        beta = jnp.asarray(x["beta"], jnp.float32)
        g = jnp.asarray(x["g"], jnp.float32)
        gates = dict(g=g, beta=beta) if family == "gdn" else dict(beta=beta)
        do = jnp.asarray(x["do"], dt)

        def jf(q, k, v, gates):
            return linear_attention(kind, q, k, v, impl="mosaic_gpu", **gates)[0]
        jfwd = jax.jit(jf)
        jfb = jax.jit(lambda *a: jax.vjp(jf, *a)[1](do))
        ms, first = time_fn(lambda: jfwd(q, k, v, gates))
        msb, firstb = time_fn(lambda: jfb(q, k, v, gates))
        line.append(f"jla fwd {ms:.3f} ms (first {first:.1f}s) fwd+bwd {msb:.3f} ms")
    except Exception as e:  # noqa: BLE001
        line.append(f"jla unavailable: {type(e).__name__}: {str(e)[:300]}")
    print(f"TIME {family} {dtype} B{B} T{T} H{H} HV{HV} K=V={K}: " + " | ".join(line), flush=True)
    print(f"FIRST-CALL s (compile) {family} {dtype}: "
          + ", ".join(f"{k} {v:.1f}" for k, v in firsts.items()), flush=True)


def profile(dtype="bf16", B=4, T=4096, H=16, HV=16, K=128):
    """Where the time of impl='mosaic' goes: each stage jitted and timed alone."""
    from fla_jax.ops.gated_delta_rule import mosaic_bwd, mosaic_layout as ml
    from fla_jax.ops.gated_delta_rule.mosaic_bwd_kernel import reverse_states
    from fla_jax.ops.gated_delta_rule.mosaic_fwd_kernel import fused_forward
    if DRYRUN:
        B, T, H, HV, K = 1, 128, 1, 1, 64
    x = inputs(3, B, T, H, HV, K, K, B)
    dt = DT[dtype]
    q, k, v = (jnp.asarray(x[n], dt) for n in ("q", "k", "v"))
    beta = jnp.asarray(x["beta"], jnp.float32)
    g = jnp.asarray(x["g"], jnp.float32)
    do = jnp.asarray(x["do"], dt)
    scale = K ** -0.5

    def prep(q, k, v, g, beta):
        lay, table = ml.plan(B, T, None)
        qr, kr, vr = ml.to_rows(q, lay), ml.to_rows(k, lay), ml.to_rows(v, lay)
        br = ml.to_rows(beta, lay)
        G, later = ml.gate_vectors(ml.to_rows(g, lay), qr.shape[0], HV)
        t0 = ml.gate_free_inverse(kr, br, HV // H, dt)
        return qr, kr, vr, t0, G, later, br.T, table

    jprep = jax.jit(prep)
    ins = jax.block_until_ready(jprep(q, k, v, g, beta))
    out = []
    ms, _ = time_fn(lambda: jprep(q, k, v, g, beta))
    out.append(f"xla prep+T0 {ms:.3f}")
    jt0 = jax.jit(lambda kr, br: ml.gate_free_inverse(kr, br, HV // H, dt))
    ms, _ = time_fn(lambda: jt0(ins[1], ins[6].T))
    out.append(f"xla T0 alone {ms:.3f}")

    def t0_trsm(kr, br):
        Rr, Hh, Kk = kr.shape
        kc = kr.reshape(Rr // 64, 64, Hh, Kk)
        kk = jnp.einsum("nihk,njhk->nhij", kc, kc, preferred_element_type=jnp.float32)
        kk = jnp.repeat(kk, HV // H, axis=1)
        bb = br.reshape(Rr // 64, 64, HV).transpose(0, 2, 1)
        a0 = jnp.tril(kk * bb[..., :, None], -1) + jnp.eye(64, dtype=jnp.float32)
        eye = jnp.broadcast_to(jnp.eye(64, dtype=jnp.float32), a0.shape)
        t = jax.scipy.linalg.solve_triangular(a0, eye, lower=True, unit_diagonal=True)
        return t.astype(dt).transpose(1, 0, 2, 3).reshape(HV, Rr, 64)
    jt1 = jax.jit(t0_trsm)
    ms, _ = time_fn(lambda: jt1(ins[1], ins[6].T))
    err = float(jnp.max(jnp.abs(jt1(ins[1], ins[6].T).astype(jnp.float32)
                                - jt0(ins[1], ins[6].T).astype(jnp.float32))))
    out.append(f"xla T0 via solve_triangular {ms:.3f} (max diff {err:.3g})")
    jf = jax.jit(lambda *a: fused_forward(*a, None, scale=scale, group=HV // H))
    ms, _ = time_fn(lambda: jf(*ins))
    out.append(f"fwd kernel {ms:.3f}")
    jfr = jax.jit(lambda *a: fused_forward(*a, None, scale=scale, group=HV // H,
                                           residuals=True))
    ms, _ = time_fn(lambda: jfr(*ins))
    out.append(f"fwd kernel+residuals {ms:.3f}")
    R = ins[0].shape[0]
    wneg = jnp.zeros((HV, R, K), dt)
    doT = ml.to_rows(do, ml.plan(B, T, None)[0]).transpose(1, 2, 0)
    jr = jax.jit(lambda *a: reverse_states(*a, None, scale=scale, group=HV // H))
    ms, _ = time_fn(lambda: jr(ins[0], ins[1], wneg, doT, ins[4], ins[5], ins[7]))
    out.append(f"reverse kernel {ms:.3f}")
    dht = jnp.zeros((B, HV, K, K), jnp.float32)
    for local in ("fp32", "input"):
        def bwd(q, k, v, g, beta, do, local=local):
            mosaic_bwd.LOCAL_MATMUL = local
            return mosaic_bwd.backward(q, k, v, g, beta, None, None, do, dht, scale=scale,
                                       l2=False)
        jb = jax.jit(bwd)
        ms, _ = time_fn(lambda: jb(q, k, v, g, beta, do))
        out.append(f"mosaic backward incl. forward recompute (local matmuls {local}) {ms:.3f}")
    mosaic_bwd.LOCAL_MATMUL = "fp32"
    print(f"PROFILE gdn {dtype} B{B} T{T} H{H} HV{HV} K=V={K} (ms): " + " | ".join(out),
          flush=True)


PLAN = [
    ("bench gdn bf16", lambda: bench("gdn", "bf16")),
    ("profile gdn bf16", lambda: profile()),
    ("ref gdn bf16 varlen l2norm mbwd", lambda: check_reference(
        "gdn", "bf16", 128, [0, 37, 37, 200, 300], True,
        "gdn bf16 varlen[0,37,37,200,300] K=V=128 l2norm h0", "mosaic")),
    ("bench gdn fp16", lambda: bench("gdn", "fp16")),
    ("ref gdn fp16 K=V=64 h0 mbwd", lambda: check_reference(
        "gdn", "fp16", 64, None, False, "gdn fp16 B2 T300 H4 K=V=64 h0", "mosaic")),
    ("ref delta bf16 K=V=128 h0 mbwd", lambda: check_reference(
        "delta", "bf16", 128, None, False, "delta bf16 B2 T300 H4 K=V=128 h0", "mosaic")),
    ("ref gdn bf16 K=V=128 h0 mbwd16", lambda: check_reference(
        "gdn", "bf16", 128, None, False, "gdn bf16 B2 T300 H4 K=V=128 h0", "mosaic16")),
    ("bench delta bf16", lambda: bench("delta", "bf16")),
    ("ref gdn bf16 K=V=256 mbwd", lambda: check_reference(
        "gdn", "bf16", 256, None, False, "gdn bf16 B2 T300 H4 K=V=256 h0", "mosaic")),
    ("bench gdn bf16 GQA H8 HV16", lambda: bench("gdn", "bf16", H=8, HV=16)),
]
ONLY = os.environ.get("GDN_ONLY")   # run only the checks whose label contains this
for label, fn in PLAN:
    if ONLY and ONLY not in label:
        continue
    if elapsed() > 95 and not DRYRUN:
        print(f"SKIP {label}: time budget ({elapsed():.0f}s)", flush=True)
        continue
    guard(label, fn)
    print(f"elapsed {elapsed():.0f}s", flush=True)
print(f"done elapsed {elapsed():.0f}s", flush=True)
