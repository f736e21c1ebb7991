"""Run a test module again in a child pytest that sees several virtual JAX CPU devices.

XLA reads --xla_force_host_platform_device_count when jax initialises, and conftest.py (and
other test modules) import jax first in this process, so a multi-device test module defines
one test here that re-runs the module in a fresh interpreter with the flag set; in that child
(`in_child()`) the module defines its real tests.

The JAX sharding modules (test_sharding_jax_{ops,kernels,layers}.py) share one child:
test_sharding_jax_ops.py's parent test runs all three (SHARDING_MODULES) in one child pytest
(one interpreter start and jax/torch import instead of three, CI time; conftest.py then
deselects the other two modules' parent tests). Collected without the ops module, the kernels
and layers modules each run their own child as before.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

CHILD_ENV = "FLA_MULTI_DEVICE_CHILD"


def in_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


SHARDING_MODULES = ("test_sharding_jax_ops.py", "test_sharding_jax_kernels.py",
                    "test_sharding_jax_layers.py")


def run_module_in_child(path, devices: int = 4, timeout: int = 300) -> str:
    """pytest `path` (a path, or a list of paths run in the same child) in a child process
    with `devices` CPU devices; fails with the child's output unless every test passes.
    Returns the child's summary line."""
    paths = [path] if isinstance(path, str) else list(path)
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{CHILD_ENV: "1"},
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-p", "no:xdist", *paths], cwd=root, env=env,
                       capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"child pytest ({devices} devices) failed:\n{out[-12000:]}"
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return f"{lines[-1] if lines else ''} ({time.perf_counter() - t0:.1f} s)"
