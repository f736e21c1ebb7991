"""GPU checks of helper pallas-fix (run from the worktree root, PYTHONPATH = that root).

    python3 scratch/gpu_pallas-fix.py            # everything, ~115 s wall clock at most

One child process per job, PARALLEL at a time (compiles are CPU-bound; the machine has 16
cores, so first-call times include that load); a job still running at the global deadline is
killed and reported as TIMEOUT with its elapsed time. Parity jobs hold a shared file lock;
timing jobs compile, then take it exclusively for their timed loops, so a timing loop has the
GPU to itself.
Lines: PASS/FAIL <job> <tensor> err=<rel RMS vs fp64> tol=<tolerance>; COMPILE <job> first
call <s>; TIME <job> fwd <ms> fwdbwd <ms>; TIMEOUT/ERROR <job>.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

DEADLINE_S = 112.0
PARALLEL = 16
DRY = os.environ.get("PF_DRY") == "1"      # CPU dry run of the plumbing: tiny shapes, interpreted
DEVICE = "cpu" if DRY else "cuda"
LOCK = "/tmp/pallas_fix_timing.lock"

PARITY_OPS = ("chunk_kda", "chunk_rwkv7", "fused_recurrent_kda", "fused_recurrent_rwkv7")
DTYPES = ("bf16", "fp16", "fp32")
TIMED = {  # job -> (family, benchmark shape)
    "time_kda_B4T4096H16K128": ("kda", dict(B=4, T=4096, H=16, HV=16, K=128, V=128)),
    "time_rwkv7_B4T4096H16K64": ("rwkv7", dict(B=4, T=4096, H=16, HV=16, K=64, V=64)),
    "time_gsa_B4T4096H4K64M64": ("gsa", dict(B=4, T=4096, H=4, HV=4, K=64, V=64, M=64)),
    "time_gla_B4T4096H16K128": ("gla", dict(B=4, T=4096, H=16, HV=16, K=128, V=128)),
}
# A/B variants (job@variant): GSA's state passes in its former 64 x 64 blocks; GLA's (the
# engine default, 64 x 64) in 32 x 32; the DPLR scores kernels on 8 warps (4: 255 registers
# and ~500 B of spills backward)
TIMED["time_gsa_B4T4096H4K64M64@gsablock64"] = TIMED["time_gsa_B4T4096H4K64M64"]
TIMED["time_gla_B4T4096H16K128@state32"] = TIMED["time_gla_B4T4096H16K128"]
TIMED["time_kda_B4T4096H16K128@warps8"] = TIMED["time_kda_B4T4096H16K128"]


def jobs():
    """Parity jobs hold a shared lock for their whole run and timing jobs take it exclusively
    after compiling, so no parity job runs on the GPU while a timing loop runs. The recurrent
    DPLR kernels (unchanged here; all PASS on the H100 at 23:51) run only when PF_JOBS names
    them."""
    out = ["gsa_fp16:tgsa_strong", "gsa_fp16:gpu_strong_uniform"]
    out += [f"parity:{op}:{dt}" for op in PARITY_OPS[:2] for dt in DTYPES]
    out += list(TIMED) + ["stages_kda"]
    only = os.environ.get("PF_JOBS")       # comma-separated subset (local checks)
    if only:
        extra = [f"parity:{op}:{dt}" for op in PARITY_OPS[2:] for dt in DTYPES]
        return [j for j in out + extra if j in only.split(",")]
    return out


# ------------------------------------------------------------------------------ child jobs
def _say(*a):
    print(*a, flush=True)


def job_gsa(case):
    """A Pallas GSA fp16 cell that failed dg before (gpu_strong_uniform: 4.5e-2 on the H100),
    against the fp64 oracle."""
    os.environ["PARITY_DEVICE"] = DEVICE
    from parity_tests.harness import check
    t = time.perf_counter()
    rows = check("chunk_gsa", case, "fp16", {"jax": "pallas"}, device=DEVICE)
    _say(f"COMPILE gsa_fp16 {case} check (incl. compile) {time.perf_counter() - t:.1f} s")
    for r in rows:
        _say(f"{'PASS' if r.passed else 'FAIL'} gsa_fp16 {case} {r.compared} {r.tensor} "
             f"err={r.error:.3e} tol={r.tolerance:.1e}")


def job_parity(op, dtype):
    from parity_tests import jax_runner, torch_runner
    from parity_tests.cases import OPS, Case, make_inputs, rel_rms, seed_of, tolerance
    spec = OPS[op]
    fam = spec.family
    case = Case(f"gpu_{fam}_B2T300", B=2, T=40 if DRY else 300, H=4, HV=4, K=64, V=64, strength=1.0,
                families=(fam,))
    raw = make_inputs(spec, case, seed_of("pallas_fix_gpu", case.name))
    act = {a.key for a in spec.activations} | {"do"}
    x = {n: torch_runner.round_to(dtype if n in act else "fp32", a) for n, a in raw.items()}
    name = f"{op}:{dtype}"
    t = time.perf_counter()
    got = jax_runner.run(spec, case, "pallas", dtype, x, device=DEVICE)
    _say(f"COMPILE {name} first call fwd+bwd (compile + run) {time.perf_counter() - t:.1f} s")
    ref = torch_runner.run(spec, case, "reference", "fp64", x, device=DEVICE)
    for tname in ref:
        err, tol = rel_rms(got[tname], ref[tname], ref[tname]), tolerance(dtype, tname)
        _say(f"{'PASS' if err <= tol else 'FAIL'} {name} {tname} err={err:.3e} tol={tol:.1e}")


def job_time(job):
    import jax

    from benchmarks.run import jax_case, make_numpy
    fam, shape = TIMED[job]
    if "@warps" in job:
        from fla_jax.ops.common.engine import dplr_scores as ds
        warps, call = int(job.split("@warps")[1]), ds._call
        ds._call = lambda kernel, ins, outs, grid, name, num_warps=4: call(
            kernel, ins, outs, grid, name, num_warps=warps)
    if "@gsablock" in job:
        from fla_jax.ops.gsa import pallas_chunk as gc
        gc.STATE_BLOCK = int(job.split("@gsablock")[1])
    if "@state" in job:
        from fla_jax.ops.common.engine import launch as lm
        from fla_jax.ops.common.engine import state_pass as sp
        blk, base = int(job.split("@state")[1]), sp.launch_for

        def small(kernel, K, V, dtype):
            lc = base(kernel, K, V, dtype)
            return lm.Launch(blk, blk, lc.num_warps, lc.num_stages)
        sp.launch_for = small
    if DRY:
        shape = dict(shape, B=1, T=64, H=1, HV=1)
    x = make_numpy(fam, shape)
    fwd, fwdbwd = jax_case(fam, x, "bf16", "pallas")
    res = {}
    for label, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        _say(f"COMPILE {job} {label} first call {time.perf_counter() - t:.1f} s")
        res[label] = fn
    with open(LOCK, "a") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        ms = {}
        for label, fn in res.items():
            for _ in range(3):
                jax.block_until_ready(fn())
            samples = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(5):
                    out = fn()
                jax.block_until_ready(out)
                samples.append((time.perf_counter() - t) * 1e3 / 5)
            ms[label] = sorted(samples)[len(samples) // 2]
        fcntl.flock(lk, fcntl.LOCK_UN)
    _say(f"TIME {job} bf16 fwd {ms['fwd']:.3f} ms fwdbwd {ms['fwdbwd']:.3f} ms")


def job_stages():
    """Each Pallas DPLR stage alone at KDA's benchmark shape (B4 T4096 H16 K=V=128: S = 256
    slots of 64 rows), fp32 slot-layout inputs: where the time goes."""
    import jax
    import jax.numpy as jnp

    from fla_jax.ops.common import pallas_triton as ptr
    from fla_jax.ops.common.engine import dplr_scores as ds
    from fla_jax.ops.common.engine import dplr_state as dst
    from fla_jax.ops.common.unit_lower_inverse import unit_lower_inverse
    N, NT, H, BT, D = (1, 2, 1, 64, 32) if DRY else (4, 64, 16, 64, 128)
    S = N * NT
    prec = ptr.dot_precision()
    key = iter(jax.random.split(jax.random.PRNGKey(0), 32))

    def rnd(*shape, scale=1.0):
        return scale * jax.random.normal(next(key), shape, jnp.float32)
    vec = lambda: rnd(S, H, BT, D, scale=D ** -0.5)  # noqa: E731
    r, k, a, b = vec(), vec(), vec(), vec()
    w = -jnp.abs(rnd(S, H, BT, D, scale=0.1))
    cts = tuple(rnd(S, H, BT, BT) for _ in range(4)) + tuple(vec() for _ in range(4)) + (
        rnd(S, H, D),)
    first = jnp.arange(N, dtype=jnp.int32) * NT
    count = jnp.full((N,), NT, jnp.int32)
    u, wy, b_out, k_out, v = vec(), vec(), vec(), vec(), vec()
    tot = jnp.exp(-jnp.abs(rnd(S, H, D)))
    h0 = rnd(N, H, D, D)
    U, S_in, dU, dS_in = vec(), rnd(S, H, D, D), vec(), rnd(S, H, D, D)
    stages = {
        "scores_fwd": lambda: ds._forward(r, k, a, b, w, prec),
        "scores_bwd": lambda: ds._backward(r, k, a, b, w, cts, prec),
        "unit_lower_inverse": lambda: unit_lower_inverse(cts[0]),
        "state_fwd": lambda: dst._forward(u, wy, b_out, k_out, v, tot, h0, first, count, prec),
        "state_bwd": lambda: dst._backward((wy, b_out, k_out, v, tot, U, S_in, first, count),
                                           (dU, dS_in, h0), True, prec),
    }
    fns = {}
    for name, f in stages.items():
        fn = jax.jit(f)
        t = time.perf_counter()
        jax.block_until_ready(fn())
        _say(f"COMPILE stage {name} first call {time.perf_counter() - t:.1f} s")
        fns[name] = fn
    with open(LOCK, "a") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        for name, fn in fns.items():
            for _ in range(3):
                jax.block_until_ready(fn())
            samples = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(5):
                    out = fn()
                jax.block_until_ready(out)
                samples.append((time.perf_counter() - t) * 1e3 / 5)
            _say(f"TIME stage {name} {sorted(samples)[3]:.3f} ms")
        fcntl.flock(lk, fcntl.LOCK_UN)


def run_child(job):
    lk = open(LOCK, "a")
    if job.startswith("parity:"):     # (the GSA cells' GPU work is small: no lock)
        fcntl.flock(lk, fcntl.LOCK_SH)
    try:
        if job.startswith("gsa_fp16:"):
            job_gsa(job.split(":")[1])
        elif job == "stages_kda":
            job_stages()
        elif job.startswith("parity:"):
            _, op, dt = job.split(":")
            job_parity(op, dt)
        else:
            job_time(job)
    except Exception as e:  # noqa: BLE001  (reported, the parent goes on)
        msg = str(e).replace("\n", " | ")[:1500]
        _say(f"ERROR {job} {type(e).__name__}: {msg}")
        sys.exit(1)


# ------------------------------------------------------------------------------ parent
def main():
    t0 = time.perf_counter()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.environ.get("PYTHONPATH", os.getcwd()))
    env.pop("TRITON_INTERPRET", None)
    procs, done, queue = {}, {}, list(jobs())
    while (queue or len(done) < len(procs)) and time.perf_counter() - t0 < DEADLINE_S:
        for j, (p, f, ts) in procs.items():
            if j not in done and p.poll() is not None:
                done[j] = time.perf_counter() - ts
        while queue and len(procs) - len(done) < PARALLEL:
            j = queue.pop(0)
            f = open(f"/tmp/pallas_fix_{j.replace(':', '_')}.log", "w+")
            p = subprocess.Popen([sys.executable, __file__, "--job", j], stdout=f,
                                 stderr=subprocess.STDOUT, env=env)
            procs[j] = (p, f, time.perf_counter())
        time.sleep(0.5)
    for j, (p, f, ts) in procs.items():
        if j not in done:
            p.kill()
            p.wait()
        f.seek(0)
        lines = f.read().splitlines()
        keep = [ln for ln in lines if ln.split(" ")[0] in
                ("PASS", "FAIL", "COMPILE", "TIME", "ERROR")]
        print(f"=== {j}: " + (f"done in {done[j]:.1f} s, rc {p.returncode}" if j in done
                               else f"TIMEOUT {j} killed after {time.perf_counter() - ts:.1f} s"))
        for ln in keep:
            print("  " + ln)
        if p.returncode not in (0, None) and not any(ln.startswith("ERROR") for ln in keep):
            print("  last output: " + " | ".join(lines[-6:])[:2000])
    for j in queue:
        print(f"=== {j}: NOT STARTED (deadline)")
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--job":
        sys.path.insert(0, os.getcwd())
        run_child(sys.argv[2])
    else:
        main()
