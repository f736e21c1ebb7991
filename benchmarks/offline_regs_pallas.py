"""Registers and spills of a Pallas op's kernels on sm_90, without a GPU (offline_regs.py's twin).

Lowers chunk_<op>(impl='pallas') forward + backward for CUDA on the CPU (Pallas' Triton lowering,
as the GPU run would), takes each kernel's Triton IR and launch (num_warps, num_stages) out of the
lowered module, and compiles it for an H100 target with the local Triton and its ptxas: what the
cubin reserves per thread (registers, stack = spilled registers, shared memory). The local
Triton and MLIR differ from the GPU machine's XLA, so numbers are indicative; the GPU timing
decides. Variants use pallas_launch_sweep.py's syntax (one engine kernel's launch or a module
constant overridden while lowering).

    PYTHONPATH=. python benchmarks/offline_regs_pallas.py --op gla
    PYTHONPATH=. python benchmarks/offline_regs_pallas.py --op gla --kernels engine_cumsum_scores \\
        --variant "launch.cumsum_scores:bk=32" --variant "launch.cumsum_scores:num_warps=8"
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the head sizes of the benchmark shape; a short sequence (a program's resources do not depend
# on the grid)
LOWER_SHAPE = dict(B=1, T=256, H=2, HV=2, K=128, V=128, M=64)
_CALL = re.compile(r'custom_call @__gpu\$xla\.gpu\.triton\([^)]*\) \{backend_config = "", '
                   r'mhlo\.backend_config = \{[^}]*?ir = "([^"]*)"(.*?)\}', re.S)


def _unescape(text: str) -> bytes:
    """The bytes of an MLIR string attribute as printed (llvm::printEscapedString: a backslash
    as two, any other unprintable byte or quote as a backslash and two hex digits)."""
    out, i = bytearray(), 0
    while i < len(text):
        if text[i] == "\\" and text[i + 1] == "\\":
            out.append(0x5C)
            i += 2
        elif text[i] == "\\":
            out.append(int(text[i + 1:i + 3], 16))
            i += 3
        else:
            out += text[i].encode("latin-1")
            i += 1
    return bytes(out)


def lowered_kernels(op: str, dtype: str = "bf16", shape: dict | None = None) -> list[dict]:
    """[{name, ttir (text), num_warps, num_stages}] of chunk_<op>(impl='pallas') fwd + bwd, one
    entry per distinct (name, launch), in the lowered module's order."""
    import jax
    import jax.numpy as jnp
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    import fla_jax.ops as ops
    from fla_jax.ops.common.dispatch import compiled_for_gpu
    import run as bench
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[dtype]
    x = bench.make_numpy(op, dict(LOWER_SHAPE, **(shape or {})))
    acts, names = bench._split(op, x)
    fn = getattr(ops, f"chunk_{op}")

    def loss(*args):
        o = fn(**dict(zip(acts + names, args)), impl="pallas")[0]
        return jnp.sum(o.astype(jnp.float32))
    args = [jnp.asarray(x[n]).astype(dt) for n in acts] + [jnp.asarray(x[n]) for n in names]
    with compiled_for_gpu():
        text = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    seen, out = set(), []
    for ir_text, rest in _CALL.findall(text):
        name = re.search(r'name = "([^"]*)"', rest).group(1)
        warps = int(re.search(r"num_warps = (\d+)", rest).group(1))
        stages = int(re.search(r"num_stages = (\d+)", rest).group(1))
        if (name, warps, stages) in seen:
            continue
        seen.add((name, warps, stages))
        with ctx:
            module = ir.Module.parse(_unescape(ir_text))
            ttir = module.operation.get_asm(enable_debug_info=False)
        out.append(dict(name=name, ttir=ttir, num_warps=warps, num_stages=stages))
    if not out:
        raise RuntimeError(f"chunk_{op}: no Pallas Triton kernel in the lowered module")
    return out


def resources(kernel: dict) -> dict:
    """{'regs', 'stack', 'shared'} of one lowered kernel compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    from offline_regs import compiled_resources
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("offline_regs_pallas compiles for sm_90: unset TRITON_INTERPRET")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{kernel['name']}.ttir")
        with open(path, "w") as f:
            f.write(kernel["ttir"])
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=kernel["num_warps"],
                                               num_stages=kernel["num_stages"]))
    return compiled_resources(compiled)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gla")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--kernels", nargs="*", default=None, help="kernel names (default: all)")
    p.add_argument("--variant", action="append", default=[],
                   help="pallas_launch_sweep.py syntax; the tree's defaults come first")
    p.add_argument("--K", type=int, default=LOWER_SHAPE["K"], help="key head size")
    p.add_argument("--V", type=int, default=LOWER_SHAPE["V"], help="value head size")
    args = p.parse_args(argv)
    from pallas_launch_sweep import Override, parse_variant
    rows = []
    for variant in ["default"] + args.variant:
        with Override([] if variant == "default" else parse_variant(variant)):
            kernels = lowered_kernels(args.op, args.dtype, dict(K=args.K, V=args.V))
        for k in kernels:
            if args.kernels and k["name"] not in args.kernels:
                continue
            r = resources(k)
            flag = "  <- spills" if r["stack"] else ""
            print(f"[{variant}] {k['name']:28s} warps {k['num_warps']} stages {k['num_stages']}: "
                  f"{r['regs']:3d} registers, stack {r['stack']:5d} B, shared {r['shared']:6d} B"
                  f"{flag}", flush=True)
            rows.append(dict(variant=variant, kernel=k["name"], warps=k["num_warps"],
                             stages=k["num_stages"], **r))
    return rows


if __name__ == "__main__":
    main()
