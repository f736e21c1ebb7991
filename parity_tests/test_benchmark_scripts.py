"""The GPU scripts under benchmarks/ still run: their CPU dry runs (tiny shape, interpreted
kernels) call every path the way the GPU run does. benchmarks/kernel_profile.py must also
produce a non-empty per-kernel table for each path and phase."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path, interpret=True):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _load(name):
    """benchmarks/<name>.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks",
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _json_lines(code, tmp_path):
    """Run `code` (benchmarks/ importable, compiled Triton: no interpreter) in a fresh process;
    the JSON lists of records it printed, one per line starting with '[{' (the scripts' own
    table lines start with '[variant]')."""
    p = _run(["-c", "import sys, json; sys.path.insert(0, 'benchmarks'); " + code], tmp_path,
             interpret=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("[{")]


def test_kernel_profile_dry_run(tmp_path):
    out = tmp_path / "profile.json"
    p = _run(["benchmarks/kernel_profile.py", "--dry-run", "--ops", "simple_gla", "--paths",
              "triton", "pallas", "--dtypes", "fp32", "--iters", "1", "--json", str(out)],
             tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(out.read_text())
    titles = [r["title"] for r in results]
    assert titles == [f"simple_gla fp32 {path} {what}" for path in ("triton", "pallas")
                      for what in ("fwd", "fwd+bwd")], (titles, p.stdout[-2000:])
    for r in results:
        assert "error" not in r and r["kernels"] and r["busy_ms"] > 0, r


def test_run_dry_run(tmp_path):
    p = _run(["benchmarks/run.py", "--dry-run", "--ops", "simple_gla", "--dtypes", "fp32"],
             tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dry run simple_gla fp32" in p.stdout, p.stdout[-2000:]


def test_regress_flags_slower_and_missing_rows(tmp_path):
    regress = _load("regress")

    def row(op, dtype, fwd, fb, path="triton"):
        return dict(shape="B4T4096", op=op, dtype=dtype, path=path, fwd_ms=fwd, fwdbwd_ms=fb)
    base = {"env": {}, "rows": [row("gla", "bf16", 1.0, 3.0), row("gla", "fp16", 1.0, 3.0),
                                row("gla", "fp32", 2.0, 6.0)]}
    new = {"env": {}, "rows": [row("gla", "bf16", 1.04, 2.0), row("gla", "fp16", 1.0, 3.2)]}
    paths = []
    for name, data in (("base", base), ("new", new)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    lines, bad = regress.compare(regress._rows(str(paths[0]), None),
                                 regress._rows(str(paths[1]), None), 1.05)
    text = "\n".join(lines)
    assert bad
    assert "| B4T4096 | gla | bf16 | triton | 1.000 / 3.000 | 1.040 / 2.000 | 1.04 / 0.67 |  |" in text
    assert "fp16 | triton | 1.000 / 3.000 | 1.000 / 3.200 | 1.00 / 1.07 | REGRESSED |" in text
    assert "fp32 | triton | 2.000 / 6.000 | missing | | MISSING |" in text
    assert regress.main([str(paths[0]), str(paths[0])]) == 0
    # a directory of run.py files reads as their union (gpu_run.sh MODE=regress: one per op)
    for name, rows in (("a", base["rows"][:1]), ("b", base["rows"][1:])):
        (tmp_path / "dir").mkdir(exist_ok=True)
        (tmp_path / "dir" / f"{name}.json").write_text(json.dumps({"env": {}, "rows": rows}))
    assert regress._rows(str(tmp_path / "dir"), None) == regress._rows(str(paths[0]), None)


def test_offline_regs_reads_the_cubin(tmp_path):
    """benchmarks/offline_regs.py compiles for sm_90 without a GPU and reads registers and
    stack from the cubin: a wider key block of the fp64 gate cumsum needs more registers, and
    every preset (the op wrappers' current launches) compiles."""
    (narrow, wide), rows = _json_lines(
        "import offline_regs as o; t = o.presets();"
        " print(json.dumps([o.resources(t['cumsum_key'], bk=b) for b in (16, 64)]));"
        " print(json.dumps(o.main(['delta_scores', 'dplr_scores_fwd'])))", tmp_path)
    assert 0 < narrow["regs"] < wide["regs"] <= 255, (narrow, wide)
    assert [r["kernel"] for r in rows] == ["delta_scores", "dplr_scores_fwd"], rows
    assert all(0 < r["regs"] <= 255 and r["stack"] >= 0 and r["shared"] > 0 for r in rows), rows


def test_offline_regs_pallas_reads_the_cubin(tmp_path):
    """benchmarks/offline_regs_pallas.py lowers a Pallas op for CUDA on the CPU, finds its
    kernels with their launches and compiles one for sm_90; a variant that narrows the key block
    reaches the lowered kernel (less shared memory)."""
    rows, = _json_lines(
        "import offline_regs_pallas as o;"
        " print(json.dumps(o.main(['--op', 'gla', '--kernels', 'engine_cumsum_scores',"
        " '--variant', 'launch.cumsum_scores:bk=16,num_warps=8'])))", tmp_path)
    assert [(r["variant"], r["kernel"]) for r in rows] == [
        ("default", "engine_cumsum_scores"),
        ("launch.cumsum_scores:bk=16,num_warps=8", "engine_cumsum_scores")], rows
    default, narrow = rows
    assert narrow["warps"] == 8 and narrow["shared"] < default["shared"], rows
    assert all(0 < r["regs"] <= 255 and r["stack"] >= 0 for r in rows), rows


def test_launch_sweep_dry_run(tmp_path):
    """Each variant's overrides reach the kernel launches they name (counted per kernel)."""
    p = _run(["benchmarks/launch_sweep.py", "--dry-run", "--op", "rwkv7", "--dtype", "fp32",
              "--variant", "dplr_output._dplr_out_fwd:num_warps=2",
              "--variant", "dplr_tail._dplr_tail_bwd:num_warps=8;dplr_wy._dplr_wy_fwd:"
              "maxnreg=None"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("dry run rwkv7 fp32")]
    assert len(lines) == 3, p.stdout[-2000:]
    assert "launches {}" in lines[0], lines
    assert "'dplr_output._dplr_out_fwd': 1" in lines[1], lines
    assert ("'dplr_tail._dplr_tail_bwd': 1" in lines[2]
            and "'dplr_wy._dplr_wy_fwd': 1" in lines[2]), lines


def test_launch_sweep_parses_variants():
    launch_sweep = _load("launch_sweep")
    assert launch_sweep.parse_variant("a.k:num_warps=4,maxnreg=None;b.j:BK=32") == [
        ("a", "k", {"num_warps": 4, "maxnreg": None}), ("b", "j", {"BK": 32})]
    for bad in ("k:num_warps=4", "a.k", "a.k:num_warps"):
        try:
            launch_sweep.parse_variant(bad)
        except ValueError as e:
            assert repr(bad) in str(e)
        else:
            raise AssertionError(f"{bad!r} parsed")


def test_pallas_launch_sweep_overrides():
    """benchmarks/pallas_launch_sweep.py: a launch override changes what every engine module's
    launch_for answers for that kernel only, a constant override sets the module constant, both
    are undone on exit, and unknown kernels / fields / constants raise."""
    import jax.numpy as jnp

    from fla_jax.ops.common.engine import cumsum_scores, launch, output_stage
    sweep = _load("pallas_launch_sweep")
    parsed = sweep.parse_variant("launch.cumsum_scores:bk=16,num_warps=8;cumsum_scores:DIAG=split")
    assert parsed == [("launch", "cumsum_scores", {"bk": 16, "num_warps": 8}),
                      ("const", "cumsum_scores", {"DIAG": "split"})]
    # booleans and floats are values, not strings ('False' was once a truthy string)
    assert sweep.parse_variant("m:A=False,B=True,C=None,D=0.5") == [
        ("const", "m", {"A": False, "B": True, "C": None, "D": 0.5})]
    before = launch.launch_for("cumsum_scores", 128, 128, jnp.bfloat16)
    other = launch.launch_for("output_fwd", 128, 128, jnp.bfloat16)
    diag = cumsum_scores.DIAG
    assert (before.bk, before.num_warps, diag) != (16, 8, "split")
    with sweep.Override(parsed) as ov:
        got = cumsum_scores.launch_for("cumsum_scores", 128, 128, jnp.bfloat16)
        assert (got.bk, got.num_warps, got.bv, got.num_stages) == (
            16, 8, before.bv, before.num_stages)
        assert output_stage.launch_for("output_fwd", 128, 128, jnp.bfloat16) == other
        assert cumsum_scores.DIAG == "split"
        assert ov.hits == {"launch.cumsum_scores": 1}
    assert cumsum_scores.launch_for("cumsum_scores", 128, 128, jnp.bfloat16) == before
    assert cumsum_scores.DIAG == diag
    from fla_jax.ops.gated_delta_rule import mosaic_chunk
    with sweep.Override(sweep.parse_variant(
            "fla_jax.ops.gated_delta_rule.mosaic_chunk:BACKWARD=pallas")):
        assert mosaic_chunk.BACKWARD == "pallas"       # a full module name outside the engine
    assert mosaic_chunk.BACKWARD == "mosaic"
    for bad in ("launch.nope:bk=16", "launch.cumsum_scores:maxnreg=1", "cumsum_scores:NOPE=1",
                "cumsum_scores:DIAG=loop;cumsum_scores:NOPE=1"):
        try:
            with sweep.Override(sweep.parse_variant(bad)):
                pass
        except ValueError as e:
            assert bad.split(":")[0].split(".")[-1] in str(e), (bad, str(e))
        else:
            raise AssertionError(f"{bad!r} accepted")
        assert cumsum_scores.DIAG == diag, bad     # a failed override leaves nothing behind
    # the delta family's tiles, for every module that called launch.delta_tiles
    from fla_jax.ops.common.engine import scalar_delta
    tiles = scalar_delta.delta_tiles(128, 128, jnp.bfloat16)
    with sweep.Override(sweep.parse_variant("tiles:grads=32/8,BT=32")) as ov:
        got = scalar_delta.delta_tiles(128, 128, jnp.bfloat16)
        assert (got.grads, got.BT, got.dh) == ((32, 8), 32, tiles.dh) and ov.hits == {"tiles": 1}
    assert scalar_delta.delta_tiles(128, 128, jnp.bfloat16) == tiles
    try:
        with sweep.Override(sweep.parse_variant("tiles:nope=1")):
            pass
    except ValueError as e:
        assert "nope" in str(e)
    else:
        raise AssertionError("tiles:nope accepted")


def test_offline_regs_pallas_unescapes_mlir_strings():
    """The lowered module prints the kernels' IR bytes as an MLIR string: a backslash as two,
    other unprintable bytes and quotes as a backslash and two hex digits (a KDA kernel's IR holds
    a backslash byte; reading it as an escape start failed)."""
    o = _load("offline_regs_pallas")
    raw = bytes(range(256))

    def mlir_escape(b: bytes) -> str:
        return "".join("\\\\" if c == 0x5C else chr(c) if 0x20 <= c < 0x7F and c != 0x22
                       else f"\\{c:02X}" for c in b)
    assert o._unescape(mlir_escape(raw)) == raw
    assert o._unescape("ML\\EFR\\5C\\\\a") == b"ML\xefR\\\\a"


def test_with_override_sets_constants_for_the_run(tmp_path):
    """benchmarks/with_override.py: the module runs with the constant set (restored after),
    and an unknown constant is an error."""
    (tmp_path / "probe_mod.py").write_text(
        "import sys\nfrom fla_jax.ops.simple_gla import mosaic_chunk\n"
        "open(sys.argv[1], 'w').write(mosaic_chunk.BACKWARD)\n")
    out = tmp_path / "seen.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    script = os.path.join(ROOT, "benchmarks", "with_override.py")
    subprocess.run([sys.executable, script, "fla_jax.ops.simple_gla.mosaic_chunk:BACKWARD=mosaic",
                    "-m", "probe_mod", str(out)], check=True, env=env, cwd=ROOT)
    assert out.read_text() == "mosaic"
    subprocess.run([sys.executable, script, "fla_jax.ops.simple_gla.mosaic_chunk:BACKWARD=pallas",
                    "-m", "probe_mod", str(out)], check=True, env=env, cwd=ROOT)
    assert out.read_text() == "pallas"
    bad = subprocess.run([sys.executable, script, "fla_jax.ops.simple_gla.mosaic_chunk:NOPE=1",
                          "-m", "probe_mod", str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "NOPE: no such constant" in bad.stderr


def test_mosaic_ptxas_parses_ptxas_report():
    mod = _load("mosaic_ptxas")
    text = ("ptxas info    : Compiling entry function 'gdn_bwd_grads_kernel' for 'sm_90a'\n"
            "ptxas info    : Function properties for gdn_bwd_grads_kernel\n"
            "    632 bytes stack frame, 784 bytes spill stores, 780 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers\n"
            "ptxas info    : Compiling entry function 'gdn_fwd_kernel' for 'sm_90a'\n"
            "ptxas info    : Used 128 registers\n")
    assert mod.parse(text) == [
        ("gdn_bwd_grads_kernel", "255 registers, stack 632 B, spill stores 784 B, loads 780 B"),
        ("gdn_fwd_kernel", "128 registers")]


def test_mosaic_kernel_time_dry_run(tmp_path):
    """benchmarks/mosaic_kernel_time.py: our T0 and ws forward kernels, interpreted at a tiny
    shape, for the defaults and a variant (a bad variant fails)."""
    args = ["benchmarks/mosaic_kernel_time.py", "--dry-run", "--variant",
            "fla_jax.ops.gated_delta_rule.mosaic_fwd_ws:MAX_STAGES=2"]
    p = _run(args, tmp_path, interpret=False)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[")]
    assert len(lines) == 2 and all("T0 " in ln and "ws forward " in ln for ln in lines), p.stdout
    p = _run(args[:3] + ["fla_jax.ops.gated_delta_rule.mosaic_fwd_ws:NO_SUCH=1"], tmp_path,
             interpret=False)
    assert p.returncode != 0


def test_dispatch_time_measures_enqueue_and_wall():
    """dispatch_time.measure on a CPU jitted function: positive times, enqueue <= wall."""
    import jax
    import jax.numpy as jnp
    mod = _load("dispatch_time")
    f = jax.jit(lambda x: jnp.tanh(x) @ x)
    enq, wall = mod.measure(f, [jnp.ones((64, 64))], inner=3, loops=3)
    assert 0 < enq <= wall


def test_mosaic_trace_summarize_synthetic():
    """mosaic_trace.summarize: per warpgroup means over CTAs of the recorded window, the time in
    top-level ranges by name (nested ranges counted once) and the rest."""
    mod = _load("mosaic_trace")
    ev = []

    def rng(tid, name, t0, t1, inner=None):
        ev.append({"name": name, "ph": "B", "ts": t0, "tid": tid, "pid": 1})
        if inner:
            ev.append({"name": inner, "ph": "B", "ts": t0 + 0.1, "tid": tid, "pid": 1})
            ev.append({"name": inner, "ph": "E", "ts": t1 - 0.1, "tid": tid, "pid": 1})
        ev.append({"name": name, "ph": "E", "ts": t1, "tid": tid, "pid": 1})
    for cta in range(2):
        base = 1 + 3 * cta
        rng(base, "wait", 0.0, 1.0)             # WG0: wait 1, mma 2 (nested mma inside), gap 1
        rng(base, "mma", 2.0, 4.0, inner="mma")
        rng(base + 1, "mma", 0.0, 3.0 + cta)    # WG1: mma 3 and 4 over the two CTAs
        rng(base + 2, "wait", 0.0, 0.5)
    s = mod.summarize({"traceEvents": ev})
    assert s[0]["window"] == 4.0 and s[0]["wait"] == 1.0 and s[0]["mma"] == 2.0
    assert s[0]["other"] == 1.0 and s[0]["ranges"] == 2
    assert s[1]["mma"] == 3.5 and s[1]["other"] == 0.0
    assert s[2]["wait"] == 0.5
    assert "WG1: window 3.50" in mod.table("x", s)


def test_mosaic_trace_profiled_patches():
    """mosaic_trace.profiled: kernels named like the pattern get the profiler's compiler
    parameters (others keep theirs), the region wrappers are installed, all restored after."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    mod = _load("mosaic_trace")
    seen = []
    real = plgpu.kernel, plgpu.barrier_wait, pl.run_state
    plgpu.kernel = lambda body, compiler_params=None, kernel_name=None, **kw: seen.append(
        (kernel_name, compiler_params))
    try:
        with mod.profiled("fwd_ws", 7, "/tmp/mosaic_trace_test"):
            assert plgpu.barrier_wait is not real[1] and pl.run_state is not real[2]
            plgpu.kernel(None, compiler_params=plgpu.CompilerParams(), kernel_name="a_fwd_ws")
            plgpu.kernel(None, compiler_params=plgpu.CompilerParams(), kernel_name="a_bwd")
        assert plgpu.barrier_wait is real[1] and pl.run_state is real[2]
    finally:
        plgpu.kernel = real[0]
    (n1, p1), (n2, p2) = seen
    assert p1.profile_space == 7 and p1.profile_dir == "/tmp/mosaic_trace_test/a_fwd_ws"
    assert p2.profile_space == 0 and p2.profile_dir == ""


def test_training_step_takes_do_as_an_argument(monkeypatch):
    """run.py's JAX training step: do is an argument of the jitted program (as in training), the
    same values as the FLA_BENCH_CONST_DO=1 program that closes over it; the kernel-by-kernel
    compile tool finds the step's kernels through it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    run = _load("run")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    do = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8)), jnp.float32)

    def f(a):
        return jnp.tanh(a) * a

    monkeypatch.delenv("FLA_BENCH_CONST_DO", raising=False)
    step = run.training_step(f, do)
    jitted, bound = step.traced_do
    assert bound is do
    assert len(jitted.trace(do, x).jaxpr.jaxpr.invars) == 2      # do and x, no constant do
    monkeypatch.setenv("FLA_BENCH_CONST_DO", "1")
    const = run.training_step(f, do)
    assert not hasattr(const, "traced_do")
    (o1, (g1,)), (o2, (g2,)) = step(x), const(x)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-6)
    t = jnp.tanh(x)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(do * (t + x * (1 - t ** 2))),
                               rtol=1e-5)


def test_kernel_compile_time_lists_the_mosaic_kernels(tmp_path):
    """benchmarks/kernel_compile_time.py --lower-only (no GPU): one row per Mosaic kernel of the
    forward and of the training step, the forward's kernels again in the step."""
    p = _run(["benchmarks/kernel_compile_time.py", "--lower-only", "--op", "simple_gla",
              "--shape", "B4T4096"], tmp_path, interpret=False)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [ln.split("|")[1:3] for ln in p.stdout.splitlines() if ln.startswith("| fwd") or
            ln.startswith("| step")]
    fwd = [k.strip() for prog, k in rows if prog.strip() == "fwd" and k.strip() != "all"]
    step = [k.strip() for prog, k in rows if prog.strip() == "step" and k.strip() != "all"]
    assert fwd and len(step) > len(fwd), p.stdout
