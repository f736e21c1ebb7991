"""Compile for sm_90, on a CPU machine, every Triton kernel launch that an op makes.

The interpreter (TRITON_INTERPRET=1, how CI runs the kernels) accepts programs the Triton
compiler rejects: a variable re-bound to another shape in one branch of an `if`, a loop-carried
value that changes dtype (both seen on the H100 only). This module closes that gap in two
steps:
1. `record_launches()` (in the interpreted test process): every `kernel[grid](...)` is
   recorded and NOT run — the function, each argument's kind (pointer and its dtype, int,
   float, constexpr value, constexpr tl.dtype) and num_warps / num_stages / maxnreg. An op
   is called at small shapes in each dtype and differentiated; the launches it makes are the
   ones to compile.
2. `compile_launches(records)` runs a fresh Python process without TRITON_INTERPRET, which
   imports the same kernels as JIT functions and compiles each distinct launch for an H100
   (GPUTarget("cuda", 90, 32)) through the stages up to `STOP` (the frontend, the Triton-GPU
   layout passes and the LLVM lowering; no ptxas). Errors come back with the kernel's name.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

STOP = "llir"

_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
                "int32": "i32", "int64": "i64", "int16": "i16", "int8": "i8", "uint8": "u8",
                "bool": "i1"}


def _describe(value):
    """A JSON-able description of one launch argument."""
    import torch
    if isinstance(value, torch.Tensor):
        return ["ptr", _DTYPE_NAMES[str(value.dtype).replace("torch.", "")]]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", value]
    if value is None:
        return ["none", None]
    if isinstance(value, str):
        return ["str", value]
    import triton.language as tl
    if isinstance(value, tl.dtype):      # a constexpr dtype (e.g. the DPLR kernels' DT)
        return ["tldtype", value.name]
    raise TypeError(f"launch argument of type {type(value).__name__} is not described")


@contextlib.contextmanager
def record_launches():
    """Yields a list that fills with one record per kernel launch; the kernels do not run."""
    from triton.runtime.interpreter import InterpretedFunction

    records = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg")
                if k in kwargs}
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        records.append({"module": self.fn.__module__, "name": self.fn.__name__,
                        "args": {k: _describe(v) for k, v in bound.items()},
                        "num_warps": opts.get("num_warps", 4),
                        "num_stages": opts.get("num_stages", 3),
                        "maxnreg": opts.get("maxnreg")})

    InterpretedFunction.run = run
    try:
        yield records
    finally:
        InterpretedFunction.run = original


def distinct(records: list) -> list:
    """One record per distinct (kernel, argument kinds and constexpr values, options)."""
    seen, out = set(), []
    for r in records:
        key = json.dumps(r, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _int_type(v: int) -> str:
    return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"


def _compile_one(rec: dict) -> str | None:
    """Compile one record (in the checker process). Returns None or the error text."""
    import importlib

    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    sig, consts = {}, {}
    for p in fn.params:
        kind, val = rec["args"][p.name]
        if kind == "tldtype":
            import triton.language as tl
            sig[p.name] = "constexpr"
            consts[p.name] = tl.dtype(val)
        elif p.is_constexpr or kind in ("none", "str"):
            sig[p.name] = "constexpr"
            consts[p.name] = val
        elif kind == "ptr":
            sig[p.name] = "*" + val
        elif kind == "bool":
            sig[p.name] = "i1"
        elif kind == "int":
            sig[p.name] = _int_type(val)
        else:
            sig[p.name] = "fp32"
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    src = ASTSource(fn, sig, consts)
    options = backend.parse_options(dict(num_warps=rec["num_warps"],
                                         num_stages=rec["num_stages"],
                                         maxnreg=rec.get("maxnreg")))
    stages = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        module = src.make_ir(target, options, backend.get_codegen_implementation(options),
                             backend.get_module_map(), context)
        metadata = {"target": target, **options.__dict__}
        for ext, step in stages.items():
            module = step(module, metadata)
            if ext == STOP:
                break
    except Exception as e:  # noqa: BLE001 - every compiler error is reported by name
        text = f"{type(e).__name__}: {e}"
        cause = e.__cause__
        while cause is not None:   # the nested function's error carries the reason
            text += f"\ncaused by {type(cause).__name__}: {cause}"
            cause = cause.__cause__
        return text[-4000:]
    return None


def _checker_main(path: str) -> None:
    with open(path) as f:
        records = json.load(f)
    failures = []
    for rec in records:
        err = _compile_one(rec)
        if err is not None:
            failures.append({"kernel": f"{rec['module']}.{rec['name']}",
                             "args": {k: v[1] for k, v in rec["args"].items()
                                      if v[0] != "ptr"},
                             "num_warps": rec["num_warps"], "error": err})
    json.dump(failures, sys.stdout)


def compile_launches(records: list, tmp_path) -> list:
    """Compile the records in a process without TRITON_INTERPRET; returns the failures."""
    path = os.path.join(str(tmp_path), "launches.json")
    with open(path, "w") as f:
        json.dump(records, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "parity_tests.triton_compile_check", path],
                         capture_output=True, text=True, env=env, cwd=root, timeout=1500)
    if res.returncode != 0:
        raise RuntimeError(f"compile checker failed: {res.stderr[-3000:]}")
    return json.loads(res.stdout)


if __name__ == "__main__":
    _checker_main(sys.argv[1])
