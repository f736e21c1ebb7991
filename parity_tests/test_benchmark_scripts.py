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
