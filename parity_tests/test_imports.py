"""fla_torch never imports jax; fla_jax never imports torch (checked in fresh interpreters)."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("package,forbidden", [("fla_torch", ("jax", "jaxlib", "flax")),
                                               ("fla_jax", ("torch", "triton"))])
def test_import_isolation(package, forbidden):
    code = (f"import sys, {package}, {package}.ops\n"
            f"import importlib\n"
            f"for m in ('layers', 'modules', 'interop'):\n"
            f"    try: importlib.import_module('{package}.' + m)\n"
            f"    except ModuleNotFoundError as e:\n"
            f"        if e.name != '{package}.' + m: raise\n"
            f"bad = [m for m in {forbidden!r} if m in sys.modules]\n"
            f"print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {package} imported {out.stdout.strip()}"
