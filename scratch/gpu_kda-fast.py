"""GPU check of chunk_kda (Triton, chunk engine): parity against the float64 reference and
timing against FLA. Run from the worktree root with PYTHONPATH=<root>:
    python3 scratch/gpu_kda-fast.py [--skip-parity] [--skip-fla] [--skip-tune]
Prints PASS/FAIL lines (rel. RMS error vs parity_tests/cases.py TOLERANCE) and timings
(median of 20 after warmup, ms) of ours and FLA's chunk_kda at B4 T4096 H16 K=V=128 bf16, and
the top-10 CUDA kernels of one fwd+bwd of ours (torch.profiler), then TUNE lines: ours with
one launch-table entry changed at a time. Sections run under time guards (SKIP lines).
Adopting a TUNE line = setting that entry as the default of the LAUNCH dict it names
(fla_torch/ops/common/engine/{delta_scores,delta_bwd,delta_state,wy}.py); its "diff vs the
default" must stay at bf16 rounding level (~1e-3)."""
import statistics
import sys
import time

import torch

from fla_torch.ops.kda import chunk_kda
from parity_tests.cases import TOLERANCE

T_START = time.time()
DEV = "cuda"
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rel_rms(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    d = (b.pow(2).mean().sqrt()).item()
    n = ((a - b).pow(2).mean().sqrt()).item()
    return 0.0 if d == 0 and n == 0 else (n / d if d else float("inf"))


def inputs(B, T, H, HV, K, V, gmin, gmax, seed, n_seq):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV, dtype=torch.float64)  # noqa
    u = lambda *s: torch.rand(*s, generator=gen, device=DEV, dtype=torch.float64)  # noqa
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    k = k / k.norm(dim=-1, keepdim=True)
    g = -(gmin + (gmax - gmin) * u(B, T, HV, K))
    beta = 0.05 + 0.9 * u(B, T, HV)
    h0 = r(n_seq, HV, K, V)
    return q, k, v, g, beta, h0


def parity(name, dtype, B=2, T=300, H=4, HV=4, K=64, V=64, h0=True, cu=None, l2=False,
           gmin=0.01, gmax=0.2):
    n_seq = B if cu is None else len(cu) - 1
    q, k, v, g, beta, hs = inputs(B, T, H, HV, K, V, gmin, gmax, 7, n_seq)
    cu_t = torch.tensor(cu, device=DEV, dtype=torch.int32) if cu is not None else None
    dt = DT[dtype]
    gen = torch.Generator(device=DEV).manual_seed(11)
    do = torch.randn(B, T, HV, V, generator=gen, device=DEV, dtype=torch.float64)
    dht = torch.randn(n_seq, HV, K, V, generator=gen, device=DEV, dtype=torch.float64)
    res = {}
    for impl, adt in (("reference", torch.float64), ("triton", dt)):
        sdt = torch.float64 if adt == torch.float64 else torch.float32
        xs = [x.to(adt).requires_grad_() for x in (q, k, v)]
        xs += [x.to(sdt).requires_grad_() for x in (g, beta)]
        s0 = hs.to(sdt).requires_grad_() if h0 else None
        o, ht = chunk_kda(*xs, initial_state=s0, output_final_state=True, cu_seqlens=cu_t,
                          use_qk_l2norm_in_kernel=l2, impl=impl)
        loss = (o.double() * do).sum() + (ht.double() * dht).sum()
        leaves = xs + ([s0] if h0 else [])
        grads = torch.autograd.grad(loss, leaves)
        names = ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if h0 else [])
        res[impl] = dict(o=o.detach(), ht=ht.detach(), **dict(zip(names, grads)))
    bad = []
    parts = []
    for n, ref in res["reference"].items():
        e = rel_rms(res["triton"][n], ref)
        tol = TOLERANCE[dtype][n]
        parts.append(f"{n}={e:.1e}")
        if not e <= tol:
            bad.append(f"{n} {e:.2e}>{tol:.0e}")
    status = "PASS" if not bad else "FAIL"
    print(f"{status} parity {name} {dtype}: " + " ".join(parts)
          + ("" if not bad else "  BAD: " + ", ".join(bad)), flush=True)


def bench_inputs(dt, B=4, T=4096, H=16, K=128, V=128):
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen, device=DEV).to(dt)
    k = torch.randn(B, T, H, K, generator=gen, device=DEV)
    k = (k / k.norm(dim=-1, keepdim=True)).to(dt)
    v = torch.randn(B, T, H, V, generator=gen, device=DEV).to(dt)
    g = -(0.01 + 0.19 * torch.rand(B, T, H, K, generator=gen, device=DEV))
    beta = 0.05 + 0.9 * torch.rand(B, T, H, generator=gen, device=DEV)
    do = torch.randn(B, T, H, V, generator=gen, device=DEV).to(dt)
    return [x.requires_grad_() for x in (q, k, v, g, beta)], do


def median_ms(fn, n=20, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def timing(label, call, leaves, do):
    def fwd():
        with torch.no_grad():
            call()

    def fwdbwd():
        for x in leaves:
            x.grad = None
        call().backward(do)
    f = median_ms(fwd)
    fb = median_ms(fwdbwd)
    print(f"TIME {label} B4 T4096 H16 K=V=128 bf16: fwd {f:.3f} ms, fwd+bwd {fb:.3f} ms",
          flush=True)
    return fwdbwd


def profile(fn):
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=10), flush=True)


def prune_fla_autotune():
    """Cut FLA's autotune to num_warps 4/8 x num_stages 2/3 (a cold full autotune of its KDA
    kernels takes minutes; this script must stay near 120 s)."""
    import importlib

    from triton.runtime.autotuner import Autotuner
    before = after = 0
    for mod in ("fla.ops.kda.chunk_intra", "fla.ops.kda.chunk_intra_token_parallel",
                "fla.ops.kda.wy_fast", "fla.ops.kda.chunk_bwd", "fla.ops.kda.gate",
                "fla.ops.common.chunk_delta_h", "fla.ops.gla.chunk", "fla.ops.utils.cumsum",
                "fla.ops.common.chunk_o", "fla.ops.utils.solve_tril"):
        try:
            m = importlib.import_module(mod)
        except Exception:  # noqa: BLE001
            continue
        for obj in list(vars(m).values()):
            for _ in range(5):
                if obj is None:
                    break
                if isinstance(obj, Autotuner):
                    keep = [c for c in obj.configs
                            if c.num_warps in (4, 8) and c.num_stages in (2, 3)]
                    before += len(obj.configs)
                    obj.configs = keep or obj.configs[:2]
                    after += len(obj.configs)
                obj = getattr(obj, "fn", None)
    print(f"FLA autotune pruned: {before} -> {after} configs (num_warps 4/8, num_stages 2/3)",
          flush=True)


def elapsed():
    return time.time() - T_START


PARITY = [
    # H=16, K=V=128 and T % 16 == 0 like the timed shape: reuses most of its compiled kernels
    dict(name="B1T304H16K128V128+h0", dtype="bf16", B=1, T=304, H=16, HV=16, K=128, V=128),
    dict(name="B2T300H4K128V128+h0", dtype="bf16", K=128, V=128),
    dict(name="B2T300H4K64V64+h0", dtype="fp32"),
    dict(name="B2T300H4K64V64+h0", dtype="fp16"),
    dict(name="B2T300H4K64V64+h0", dtype="bf16"),
    dict(name="strong-gates[-20,-10]K64+h0", dtype="fp32", gmin=10.0, gmax=20.0),
    dict(name="GQA-H2-HV4+l2norm,no-h0", dtype="fp16", H=2, HV=4, l2=True, h0=False),
    dict(name="varlen[0,37,37,300,600]K64+h0", dtype="bf16", B=1, T=600,
         cu=[0, 37, 37, 300, 600]),
    dict(name="B2T300H4K128V128+h0", dtype="fp32", K=128, V=128),
    dict(name="strong-gates[-20,-10]K64+h0", dtype="bf16", gmin=10.0, gmax=20.0),
]


def tune(leaves, do, limit):
    """fwd and fwd+bwd of ours with one launch-table entry changed at a time (the tables of
    engine/delta_scores.py, wy.py, delta_state.py, delta_bwd.py)."""
    from fla_torch.ops.common.engine import delta_bwd, delta_scores, delta_state, wy
    variants = [
        ("delta_bwd", delta_bwd.LAUNCH, dict(SCRATCH=False)),
        ("delta_scores", delta_scores.LAUNCH, dict(BK=32, num_warps=4)),
        ("delta_state.fwd", delta_state.LAUNCH["fwd"], dict(num_stages=2)),
        ("delta_state.bwd", delta_state.LAUNCH["bwd"], dict(num_stages=3)),
        ("delta_state.bwd", delta_state.LAUNCH["bwd"], dict(BV=32, num_warps=4)),
        ("delta_scores", delta_scores.LAUNCH, dict(BK=64, num_warps=8)),
        ("delta_bwd", delta_bwd.LAUNCH, dict(BK=32, BV=64, num_warps=4)),
        ("delta_state.fwd", delta_state.LAUNCH["fwd"], dict(BV=32, num_warps=4)),
        ("delta_bwd", delta_bwd.LAUNCH, dict(SCRATCH=False, BK=32, num_warps=4)),
        ("delta_bwd", delta_bwd.LAUNCH, dict(BK=64, BV=64, num_warps=4)),
        ("delta_state.bwd", delta_state.LAUNCH["bwd"], dict(BV=64, num_warps=8)),
        ("wy.fwd", wy.LAUNCH, dict(fwd_warps=8)),
        ("delta_bwd", delta_bwd.LAUNCH, dict(BK=64, BV=32, num_warps=8)),
    ]
    q, k, v, g, beta = leaves
    call = lambda: chunk_kda(q, k, v, g, beta, impl="triton")[0]  # noqa: E731

    def fb():
        for x in leaves:
            x.grad = None
        call().backward(do)

    def fw():
        with torch.no_grad():
            call()

    def outputs():
        for x in leaves:
            x.grad = None
        o = call()
        o.backward(do)
        return [o.detach().float()] + [x.grad.detach().float().clone() for x in leaves]
    base = outputs()
    for name, table, change in variants:
        if elapsed() > limit:
            print(f"SKIP TUNE {name} {change}: time guard ({elapsed():.0f} s)", flush=True)
            continue
        old = dict(table)
        table.update(change)
        try:
            f, b = median_ms(fw, n=10, warm=2), median_ms(fb, n=10, warm=2)
            diff = max(rel_rms(x, y) for x, y in zip(outputs(), base))
            print(f"TUNE {name} {change}: fwd {f:.3f} ms, fwd+bwd {b:.3f} ms, max rel. RMS "
                  f"diff of o and grads vs the default {diff:.1e} (default {old})", flush=True)
        except Exception as e:   # noqa: BLE001
            print(f"TUNE {name} {change}: FAILED {e!r}", flush=True)
        table.clear()
        table.update(old)


def run_parity(cases, limit):
    for c in cases:
        if elapsed() > limit:
            print(f"SKIP parity {c['name']} {c['dtype']}: time guard ({elapsed():.0f} s)")
            continue
        c = dict(c)
        name, dtype = c.pop("name"), c.pop("dtype")
        try:
            parity(name, dtype, **c)
        except Exception:   # noqa: BLE001
            import traceback
            print(f"FAIL parity {name} {dtype}: exception\n" + traceback.format_exc()[-2000:],
                  flush=True)


def main(argv):
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}", flush=True)
    leaves, do = bench_inputs(torch.bfloat16)
    try:
        ours = timing("ours(triton)", lambda: chunk_kda(*leaves, impl="triton")[0], leaves, do)
        print(f"ours timed at {elapsed():.0f} s", flush=True)
        print("PROFILE ours fwd+bwd (top 10 CUDA kernels):", flush=True)
        profile(ours)
    except Exception:   # noqa: BLE001
        import traceback
        print("FAIL ours timing:\n" + traceback.format_exc()[-3000:], flush=True)
    if "--skip-parity" not in argv:
        run_parity(PARITY[:1], 60)
    if "--skip-fla" not in argv:
        try:
            import fla.ops.kda as fk
            prune_fla_autotune()
            q, k, v, g, beta = leaves
            fla_fb = timing("FLA chunk_kda",
                            lambda: fk.chunk_kda(q=q, k=k, v=v, g=g, beta=beta)[0], leaves, do)
            print(f"FLA timed at {elapsed():.0f} s", flush=True)
            print("PROFILE FLA fwd+bwd (top 10 CUDA kernels):", flush=True)
            profile(fla_fb)
        except Exception as e:   # noqa: BLE001
            print(f"SKIP FLA: {e!r}")
    if "--skip-parity" not in argv:
        run_parity(PARITY[1:4], 100)
    if "--skip-tune" not in argv:
        tune(leaves, do, 105)
    if "--skip-parity" not in argv:
        run_parity(PARITY[4:], 110)
    print(f"done at {elapsed():.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
