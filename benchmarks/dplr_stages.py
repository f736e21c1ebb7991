"""The Pallas DPLR pipeline (chunk_rwkv7, impl='pallas') on the GPU: the whole op under each
of dplr_scores' DIAG switches, and each stage alone (forward; forward + vjp), bf16 B4 T4096
H16 K=V=64 (run.py's B4T4096K64). Complements kernel_profile.py with the A / B of the switch.

    PYTHONPATH=. python3 benchmarks/dplr_stages.py whole stages
    PYTHONPATH=. python3 benchmarks/dplr_stages.py sweep   # launch / product-precision sweep
    PYTHONPATH=. python3 benchmarks/dplr_stages.py variants  # the scores kernels' launches
    PYTHONPATH=. python3 benchmarks/dplr_stages.py diag16    # bf16 diagonal blocks or not
    PROBE_SMALL=1 PYTHONPATH=. python3 benchmarks/dplr_stages.py    # CPU smoke run, no timing
Prints WHOLE / STAGE / SWEEP / CHOSEN lines (ms, median of run.time_jax). `sweep` times each
stage (forward, forward + vjp) under each launch option and bf16-problem product precision
(ptr.SPLIT3 / ptr.BF16), one knob at a time, keeps the fastest, then times the whole op
with the defaults and with the chosen knobs."""
import os
import sys
sys.path.insert(0, "benchmarks")
import dataclasses  # noqa: E402
import json  # noqa: E402
import run as R  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from fla_jax.ops.common import pallas_triton as ptr  # noqa: E402
from fla_jax.ops.common.engine import dplr, dplr_scores as ds, dplr_wy, dplr_output  # noqa
from fla_jax.ops.common.engine import dplr_state  # noqa: E402

SHAPE = (dict(B=1, T=128, H=1, HV=1, K=64, V=64) if os.environ.get("PROBE_SMALL")
         else R.SHAPES["B4T4096K64"])
x = R.make_numpy("rwkv7", SHAPE)
if os.environ.get("PROBE_SMALL"):
    def _once(fn, loops=1, inner=1):                         # CPU smoke test: run once
        jax.block_until_ready(fn())
        return 0.0, 0.0
    R.time_jax = _once
which = sys.argv[1:] or ["whole", "stages"]


def whole(tag):
    fwd, fb = R.jax_case("rwkv7", x, "bf16", "pallas")
    f, first = R.time_jax(fwd)
    b, _ = R.time_jax(fb)
    print(f"WHOLE {tag}: fwd {f:.3f} fwd+bwd {b:.3f} (first fwd call {first:.1f} s)", flush=True)
    return f, b


def stage(tag, fn, *a):
    f = jax.jit(fn)
    ms, _ = R.time_jax(lambda: f(*a))
    print(f"STAGE {tag}: {ms:.3f}", flush=True)


def vjp_stage(tag, fn, *a):
    """fn's forward and its vjp (cotangents ones) timed apart."""
    stage(tag + " fwd", fn, *a)

    def both(*a):
        y, vjp = jax.vjp(fn, *a)
        return vjp(jax.tree_util.tree_map(jnp.ones_like, y))
    stage(tag + " fwd+vjp", both, *a)


if "whole" in which:                       # add "loop" to time DIAG "loop" too
    for d in ("split", "loop") if "loop" in which else ("split",):
        ds.DIAG = d
        whole(f"diag={d}")
    ds.DIAG = "split"

B, T, H, K = x["r"].shape if "r" in x else x["q"].shape
key = jax.random.PRNGKey(0)
S, BT, Kp = B * (T // 64), 64, K


def _rnd(*s):
    return jax.random.normal(key, s, jnp.float32) * 0.3


def stage_inputs():
    r, k, a, b = (_rnd(S, H, BT, Kp) for _ in range(4))
    w = -jax.random.uniform(key, (S, H, BT, Kp)) * 0.6
    A = jnp.tril(_rnd(S, H, BT, BT), -1) * 0.1
    first = jnp.arange(B, dtype=jnp.int32) * (T // 64)
    count = jnp.full((B,), T // 64, jnp.int32)
    tm = lambda t: jnp.swapaxes(t, 1, 2)       # noqa: E731  token-major [S, BT, H, D]
    return dict(r=r, k=k, a=a, b=b, w=w, A=A, Sin=_rnd(S, H, Kp, Kp), first=first,
                count=count, tot=jnp.exp(jnp.sum(w, axis=2)), vt=tm(r),
                tok=tuple(tm(t) for t in (r, k, a, b, w)))


def _ms(fn, *a):
    """(forward ms, forward + vjp ms) of fn at the knobs now set; None on an error."""
    try:
        f = jax.jit(fn)

        def both(*a):
            y, vjp = jax.vjp(fn, *a)
            return vjp(jax.tree_util.tree_map(jnp.ones_like, y))
        fb = jax.jit(both)
        return R.time_jax(lambda: f(*a), 7, 10)[0], R.time_jax(lambda: fb(*a), 7, 10)[0]
    except Exception as e:                                  # noqa: BLE001
        print(f"  error: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def _best(tag, options, apply, fn, *a, key_fb=True):
    """Times fn under each option (apply(option) sets it), prints SWEEP lines, applies and
    returns the fastest (by forward + vjp, or forward alone with key_fb False)."""
    best, best_t = None, None
    for o in options:
        apply(o)
        t = _ms(fn, *a)
        print(f"SWEEP {tag} {o}: " + ("error" if t is None else f"fwd {t[0]:.3f} fwd+vjp {t[1]:.3f}"),
              flush=True)
        if t is not None and (best_t is None or t[1 if key_fb else 0] < best_t):
            best, best_t = o, t[1 if key_fb else 0]
    apply(best)
    return best


def sweep():
    whole("defaults")
    i = stage_inputs()
    chosen = {}
    for prec in (ptr.SPLIT3, ptr.BF16):
        sc = lambda r, k, a, b, w, p=prec: ds.dplr_scores(r, k, a, b, w, p)  # noqa: E731
        args = i["tok"]
        wf = _best(f"scores[{prec}] fwd warps", (2, 4, 8),
                   lambda o: ds.WARPS.__setitem__("fwd", o), sc, *args, key_fb=False)
        wb = _best(f"scores[{prec}] bwd warps", (2, 4, 8),
                   lambda o: ds.WARPS.__setitem__("bwd", o), sc, *args)
        chosen[f"scores {prec}"] = (wf, wb)
    chosen["scores BK"] = _best("scores BK", (16, 32, 64), lambda o: ds.BK.append(o), sc, *args)
    prec = ptr.BF16
    base = {"wy": dplr_wy.LAUNCH, "output": dplr_output.LAUNCH}

    def set_launch(mod, o):
        mod.LAUNCH = dataclasses.replace(base[mod.__name__.split(".")[-1].split("_")[-1]],
                                         num_warps=o)
    chosen["wy"] = _best("wy warps", (2, 4, 8), lambda o: set_launch(dplr_wy, o),
                         lambda A, Ak, v, ai: dplr_wy.dplr_wy(A, Ak, v, ai, prec),
                         i["A"], i["A"], i["vt"], i["a"])
    chosen["output"] = _best("output warps", (2, 4, 8), lambda o: set_launch(dplr_output, o),
                             lambda *t: dplr_output.dplr_output(*t, 0.125, prec),
                             i["r"], i["Sin"], i["A"], i["r"], i["A"], i["vt"])
    st = lambda u, wy, bo, ko, v, tot: dplr_state.dplr_state(  # noqa: E731
        u, wy, bo, ko, v, tot, None, i["first"], i["count"], prec, True)[:2]
    chosen["state"] = _best("state warps,bv", ((2, 16), (4, 16), (2, 32), (4, 32), (8, 32)),
                            lambda o: dplr_state.LAUNCH.update(warps=o[0], bv=o[1]), st,
                            i["r"], i["a"] * 0.1, i["b"], i["k"], i["vt"], i["tot"])
    print("CHOSEN " + json.dumps({k: str(v) for k, v in chosen.items()}), flush=True)
    whole("chosen (BF16 products)")
    dplr.BF16_PRODUCTS.append(ptr.SPLIT3)
    ds.WARPS.update(fwd=chosen[f"scores {ptr.SPLIT3}"][0], bwd=chosen[f"scores {ptr.SPLIT3}"][1])
    whole("chosen launches, SPLIT3 products")
    dplr.BF16_PRODUCTS.pop()


# the scores kernels' launch variants timed on the whole op by `variants`:
# name -> (WARPS, STAGES)
VARIANTS = {
    "stages_1_1": ({"fwd": 4, "bwd": 4}, {"fwd": 1, "bwd": 1}),
    "stages_3_3": ({"fwd": 4, "bwd": 4}, {"fwd": 3, "bwd": 3}),
    "stages_1_3": ({"fwd": 4, "bwd": 4}, {"fwd": 1, "bwd": 3}),
    "stages_3_3_bwd_w8": ({"fwd": 4, "bwd": 8}, {"fwd": 3, "bwd": 3}),
}


def variants():
    """Times the whole op under each VARIANTS entry; prints BEST <name> <json config>."""
    best = None
    base = (dict(ds.WARPS), dict(ds.STAGES))
    for name, (warps, stages) in VARIANTS.items():
        ds.WARPS.update(warps)
        ds.STAGES.update(stages)
        try:
            _, b = whole(name)
            if best is None or b < best[0]:
                best = (b, name, warps, stages)
        except Exception as e:                              # noqa: BLE001
            print(f"WHOLE {name}: error {type(e).__name__}: {str(e)[:300]}", flush=True)
        ds.WARPS.update(base[0])
        ds.STAGES.update(base[1])
    print("BEST " + best[1] + " " + json.dumps(dict(warps=best[2], stages=best[3])),
          flush=True)


def apply(path):
    """Writes the BEST line of a `variants` output into engine/dplr_scores.py's constants
    (for the rest of a GPU call; the repository's defaults change by hand)."""
    line = [x for x in open(path) if x.startswith("BEST ")][-1]
    cfg = json.loads(line.split(" ", 2)[2])
    src = ds.__file__
    out = []
    for x in open(src):
        if x.startswith("WARPS = "):
            x = f"WARPS = {json.dumps(cfg['warps'])}\n"
        elif x.startswith("STAGES = "):
            x = f"STAGES = {json.dumps(cfg['stages'])}\n"
        out.append(x)
    open(src, "w").write("".join(out))
    print("applied", cfg)


if "sweep" in which:
    sweep()

if "variants" in which:
    variants()

if "diag16" in which:    # bf16 problems' diagonal blocks (fwd, bwd): bf16 product / accurate
    base = dict(ds.DIAG_BF16)
    for f, b in ((False, False), (False, True), (True, True)):
        ds.DIAG_BF16.update(fwd=f, bwd=b)
        try:
            whole(f"DIAG_BF16 fwd={f} bwd={b}")
        except Exception as e:                              # noqa: BLE001
            print(f"WHOLE DIAG_BF16 fwd={f} bwd={b}: error {type(e).__name__}: {str(e)[:300]}")
    ds.DIAG_BF16.update(base)

if "apply" in which:
    apply(sys.argv[-1])

if "stages" in which:
    i = stage_inputs()
    prec = dplr.precision(jnp.bfloat16)            # as the bf16 op's stages
    for d in ("split", "loop"):
        ds.DIAG = d
        vjp_stage(f"scores diag={d}", lambda *t: ds.dplr_scores(*t, prec), *i["tok"])
    ds.DIAG = "split"
    vjp_stage("wy", lambda A, Ak, v, ai: dplr_wy.dplr_wy(A, Ak, v, ai, prec),
              i["A"], i["A"], i["vt"], i["a"])
    vjp_stage("output", lambda *t: dplr_output.dplr_output(*t, 0.125, prec),
              i["r"], i["Sin"], i["A"], i["r"], i["A"], i["vt"])
    vjp_stage("state", lambda u, wy, bo, ko, v, tot: dplr_state.dplr_state(
        u, wy, bo, ko, v, tot, None, i["first"], i["count"], prec, True)[:2],
        i["r"], i["a"] * 0.1, i["b"], i["k"], i["vt"], i["tot"])
    xt = jnp.asarray(x["r"] if "r" in x else x["q"]).astype(jnp.bfloat16)
    stage("to_slots (one input)", lambda t: dplr.to_slots(t, None, S, Kp), xt)
