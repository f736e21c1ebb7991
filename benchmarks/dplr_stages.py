"""The Pallas DPLR pipeline (chunk_rwkv7, impl='pallas') on the GPU: the whole op under each
of dplr_scores' DIAG switches, and each stage alone (forward; forward + vjp), bf16 B4 T4096
H16 K=V=64 (run.py's B4T4096K64). Complements kernel_profile.py with the A / B of the switch.

    PYTHONPATH=. python3 benchmarks/dplr_stages.py whole stages
    PROBE_SMALL=1 PYTHONPATH=. python3 benchmarks/dplr_stages.py    # CPU smoke run, no timing
Prints WHOLE / STAGE lines (ms, median of run.time_jax)."""
import os
import sys
sys.path.insert(0, "benchmarks")
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


if "whole" in which:
    for d in ("split", "loop"):
        ds.DIAG = d
        whole(f"diag={d}")
    ds.DIAG = "split"

if "stages" in which:
    B, T, H, K = x["r"].shape if "r" in x else x["q"].shape
    key = jax.random.PRNGKey(0)
    S, BT, Kp = B * (T // 64), 64, K
    rnd = lambda *s: jax.random.normal(key, s, jnp.float32) * 0.3  # noqa: E731
    prec = ptr.problem_precision(jnp.bfloat16)     # as the bf16 op's stages
    r, k, a, b = (rnd(S, H, BT, Kp) for _ in range(4))
    w = -jax.random.uniform(key, (S, H, BT, Kp)) * 0.6
    for d in ("split", "loop"):
        ds.DIAG = d
        vjp_stage(f"scores diag={d}", lambda r, k, a, b, w: ds.dplr_scores(r, k, a, b, w, prec),
                  r, k, a, b, w)
    ds.DIAG = "split"
    A = jnp.tril(rnd(S, H, BT, BT), -1) * 0.1
    vjp_stage("wy", lambda A, Ak, v, ai: dplr_wy.dplr_wy(A, Ak, v, ai, prec), A, A, r, a)
    Sin = rnd(S, H, Kp, Kp)
    vjp_stage("output", lambda *t: dplr_output.dplr_output(*t, 0.125, prec), r, Sin, A, r, A, k)
    first = jnp.arange(B, dtype=jnp.int32) * (T // 64)
    count = jnp.full((B,), T // 64, jnp.int32)
    tot = jnp.exp(jnp.sum(w, axis=2))
    vjp_stage("state", lambda u, wy, bo, ko, v, tot: dplr_state.dplr_state(
        u, wy, bo, ko, v, tot, None, first, count, prec)[:2], r, a * 0.1, b, k, r, tot)
    xt = jnp.asarray(x["r"] if "r" in x else x["q"]).astype(jnp.bfloat16)
    stage("to_slots (one input)", lambda t: dplr.to_slots(t, None, S, Kp), xt)
