"""GPU check of Triton chunk_rwkv7 (DPLR pipeline): parity vs the fp64 reference, timings vs
FLA, per-kernel profile. Run from the worktree root with PYTHONPATH=. (prints PASS/FAIL lines)."""
import os
import statistics
import sys
import time
import traceback

import torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: a check of this script only
os.environ["PARITY_DEVICE"] = DEV
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    from parity_tests import triton_interpret_patch
    triton_interpret_patch.apply()

T0 = time.time()


def section(name):
    print(f"\n=== {name} (t={time.time() - T0:.1f}s) ===", flush=True)


def parity():
    from parity_tests import cases
    from parity_tests.cases import Case
    from parity_tests.harness import check
    fam = ("rwkv7", "kda")
    new = [Case("g_b2", B=2, T=300, H=4, HV=4, K=64, V=64, strength=1.0, families=fam),
           Case("g_varlen", B=1, T=300, H=4, HV=4, K=64, V=64, cu_seqlens=(0, 5, 70, 70, 300),
                strength=1.0, families=fam),
           Case("g_strong", B=2, T=300, H=4, HV=4, K=64, V=64, strength=20.0, floor=0.05,
                families=fam),
           Case("g_uniform", B=1, T=300, H=4, HV=4, K=64, V=64, cu_seqlens=(0, 130, 300),
                strength=20.0, floor=0.5, families=fam),
           Case("g_noh0", B=2, T=300, H=4, HV=4, K=64, V=64, strength=0.1, h0=False,
                families=fam)]
    for c in new:
        cases.CASES[c.name] = c
    jobs = [("chunk_rwkv7", c.name, "bf16") for c in new]
    jobs += [("chunk_rwkv7", c, d) for c in ("g_varlen", "g_strong") for d in ("fp32", "fp16")]
    jobs += [("chunk_rwkv7", "g_uniform", "fp16"), ("chunk_kda", "g_strong", "fp32")]
    if DEV == "cpu":
        jobs = [("chunk_rwkv7", "g_varlen", "fp16")]
    for op, case, dt in jobs:
        t = time.time()
        try:
            rows = check(op, case, dt, {"torch": "triton"}, device=DEV)
            bad = [r for r in rows if not r.passed]
            worst = max(rows, key=lambda r: r.error / r.tolerance)
            print(f"{'PASS' if rows and not bad else 'FAIL'} parity {op} {case} {dt}: "
                  f"{len(rows)} tensors, worst {worst.tensor} err={worst.error:.2e} "
                  f"tol={worst.tolerance:.0e} ({time.time() - t:.1f}s)", flush=True)
            for r in bad:
                print(f"    FAIL {r.tensor} err={r.error:.3e} tol={r.tolerance:.1e}")
        except Exception as e:  # noqa: BLE001
            print(f"FAIL parity {op} {case} {dt}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)


def _time(fn, params, n=20):
    for _ in range(3):
        fn()
        for p in params:
            p.grad = None
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def _profile(name, fn, params):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            for p in params:
                p.grad = None
            fn()
        torch.cuda.synchronize()
    print(f"--- {name}: top 12 kernels, fwd+bwd x3 (device ms total, calls) ---")
    evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
    for e in evs:
        print(f"  {e.device_time_total / 1e3:9.3f} ms  {e.count:4d}  {e.key[:90]}")


def bench(labels=("ours",)):
    sys.path.insert(0, os.getcwd())
    from benchmarks.run import SHAPES, make_numpy, torch_case
    x = make_numpy("rwkv7", SHAPES["B4T4096K64"])
    res = {}
    for label, fla in (("ours", False), ("fla", True)):
        if label not in labels:
            continue
        try:
            t = time.time()
            fwd, fwdbwd, params = torch_case("rwkv7", x, "bf16", "triton", fla=fla)
            fwdbwd()
            torch.cuda.synchronize()
            first = time.time() - t
            res[label] = (_time(fwd, params), _time(fwdbwd, params))
            print(f"TIME {label} chunk_rwkv7 bf16 B4 T4096 H16 K=V=64: fwd {res[label][0]:.3f} ms, "
                  f"fwd+bwd {res[label][1]:.3f} ms (first call {first:.1f}s)", flush=True)
            _profile(label, fwdbwd, params)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL timing {label}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
    if "ours" in res and "fla" in res:
        print(f"RATIO ours/fla: fwd {res['ours'][0] / res['fla'][0]:.2f}x, "
              f"fwd+bwd {res['ours'][1] / res['fla'][1]:.2f}x")
    return x


def variants(x):
    """Tile choices of ours, timed the same way (monkeypatched; each compiles anew)."""
    from benchmarks.run import torch_case
    from fla_torch import dtypes
    from fla_torch.ops.common.engine import dplr_scores, dplr_scores_bwd, dplr_state
    st_tiles, sc_bk = dplr_state._tiles, dplr_scores._bk
    cases = [("scores 4 warps", lambda: (setattr(dplr_scores, "WARPS", 4),
                                         setattr(dplr_scores_bwd, "WARPS", 4))),
             ("state BV=16", lambda: setattr(dplr_state, "_tiles", lambda K, V: (st_tiles(K, V)[0], 16))),
             ("state BV=64", lambda: setattr(dplr_state, "_tiles", lambda K, V: (st_tiles(K, V)[0], 64))),
             ("scores forward BK 32", lambda: setattr(dplr_scores, "_bk", lambda K, cap: min(K, 32))),
             ("state num_stages=2", lambda: setattr(dplr_state, "STAGES", 2)),
             ("allow_tf32 (tf32 dots)", None)]
    for name, patch in cases:
        if time.time() - T0 > 90:
            print(f"SKIP variant {name}: time")
            continue
        try:
            dplr_state._tiles, dplr_scores._bk, dplr_state.STAGES = st_tiles, sc_bk, 1
            dplr_scores.WARPS = dplr_scores_bwd.WARPS = 8
            if patch is not None:
                patch()
            fwd, fwdbwd, params = torch_case("rwkv7", x, "bf16", "triton")
            if patch is None:
                with dtypes.allow_tf32():
                    fwdbwd()
                    ms = (_time(fwd, params, 10), _time(fwdbwd, params, 10))
            else:
                fwdbwd()
                ms = (_time(fwd, params, 10), _time(fwdbwd, params, 10))
            print(f"VARIANT {name}: fwd {ms[0]:.3f} ms, fwd+bwd {ms[1]:.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL variant {name}: {type(e).__name__}: {e}", flush=True)
    dplr_state._tiles, dplr_scores._bk, dplr_state.STAGES = st_tiles, sc_bk, 1
    dplr_scores.WARPS = dplr_scores_bwd.WARPS = 8


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu")
    which = sys.argv[1:] or ["bench", "parity", "variants", "fla"]
    x = None
    if "bench" in which:
        section("timing")
        x = bench()
    if "parity" in which:
        section("parity vs fp64 reference")
        parity()
    if "variants" in which and x is not None:
        section("variants of ours")
        variants(x)
    if "fla" in which:
        section("FLA (its first call autotunes)")
        bench(("fla",))
    section("done")
