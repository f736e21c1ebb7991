"""The GPU scripts under benchmarks/ still run: their CPU dry runs (tiny shape, interpreted
kernels) call every path the way the GPU run does. benchmarks/kernel_profile.py must also
produce a non-empty per-kernel table for each path and phase."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


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
    import importlib.util
    spec = importlib.util.spec_from_file_location("regress", os.path.join(ROOT, "benchmarks",
                                                                          "regress.py"))
    regress = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regress)

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
