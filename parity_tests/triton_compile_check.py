"""Compile for sm_90, on a CPU machine, every Triton kernel launch that an op makes.

The interpreter (TRITON_INTERPRET=1, how CI runs the kernels) accepts programs the Triton
compiler rejects: a variable re-bound to another shape in one branch of an `if`, a loop-carried
value that changes dtype (both seen on the H100 only). This module closes that gap in two
steps:
1. `record_launches()` (in the interpreted test process): every `kernel[grid](...)` is
   recorded and NOT run — the function, each argument's kind (pointer and its dtype, int,
   float, constexpr value, constexpr tl.dtype), its parameters and which are constexpr, and
   num_warps / num_stages / maxnreg. An op is called at small shapes in each dtype and
   differentiated; the launches it makes are the ones to compile.
2. `compile_launches(records)` runs a fresh Python process without TRITON_INTERPRET, which
   imports the same kernels as JIT functions and compiles each distinct launch for an H100
   (GPUTarget("cuda", 90, 32)) through the stages up to `STOP` (the frontend, the Triton-GPU
   layout passes and the LLVM lowering; no ptxas). Errors come back with the kernel's name.
   `Checker` does the same in one such process kept across calls.
`distinct(records)` keeps one record per `compile_key`: exactly what `_compile_one` hands the
compiler (kernel, signature, constexpr values, options), so launches that differ only in a
runtime int's value (same i32 / i64 type) or a runtime float's value compile once.
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


def _constexpr_names(fn) -> list:
    """Names of fn's tl.constexpr parameters, as the JIT decides them (KernelParam)."""
    import inspect

    from triton.runtime.jit import KernelParam
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in (KernelParam(i, prm, False, False) for i, prm in enumerate(params))
            if p.is_constexpr]


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
                        "params": list(self.arg_names),
                        "constexprs": _constexpr_names(self.fn),
                        "num_warps": opts.get("num_warps", 4),
                        "num_stages": opts.get("num_stages", 3),
                        "maxnreg": opts.get("maxnreg")})

    InterpretedFunction.run = run
    try:
        yield records
    finally:
        InterpretedFunction.run = original


def _int_type(v: int) -> str:
    return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"


def _signature(rec: dict, params, constexprs) -> tuple:
    """(signature {param: type}, constexprs {param: [kind, value]}): what the compiler gets
    for this record of a kernel with these parameters (in order) and constexpr ones."""
    sig, consts = {}, {}
    for name in params:
        kind, val = rec["args"][name]
        if kind == "tldtype" or name in constexprs or kind in ("none", "str"):
            sig[name] = "constexpr"
            consts[name] = [kind, val]
        elif kind == "ptr":
            sig[name] = "*" + val
        elif kind == "bool":
            sig[name] = "i1"
        elif kind == "int":
            sig[name] = _int_type(val)
        else:
            sig[name] = "fp32"
    return sig, consts


def compile_key(rec: dict) -> str:
    """Everything a compile of `rec` depends on: the kernel, its signature, the constexpr
    values and the launch options; runtime ints / floats only through their type."""
    sig, consts = _signature(rec, rec["params"], rec["constexprs"])
    return json.dumps([rec["module"], rec["name"], list(sig.items()), sorted(consts.items()),
                       rec["num_warps"], rec["num_stages"], rec.get("maxnreg")])


def distinct(records: list) -> list:
    """One record per compile_key, sorted by the key; each carries in 'where' the union of
    the 'where' labels (who launched it) of the records it stands for."""
    out = {}
    for r in records:
        k = compile_key(r)
        if k not in out:
            out[k] = dict(r, where=[])
        out[k]["where"] += [w for w in r.get("where", []) if w not in out[k]["where"]]
    return [out[k] for k in sorted(out)]


def _compile_one(rec: dict) -> str | None:
    """Compile one record (in the checker process). Returns None or the error text."""
    import importlib

    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    names = [p.name for p in fn.params]
    constexprs = [p.name for p in fn.params if p.is_constexpr]
    if (rec.get("params", names), rec.get("constexprs", constexprs)) != (names, constexprs):
        # compile_key (in the test process) and this compile must see the same parameters
        return (f"recorded parameters {rec['params']} (constexpr {rec['constexprs']}) are "
                f"not the JIT function's {names} (constexpr {constexprs})")
    sig, described = _signature(rec, names, constexprs)
    consts = {}
    for name, (kind, val) in described.items():
        if kind == "tldtype":
            import triton.language as tl
            val = tl.dtype(val)
        consts[name] = val
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


def _failures(records: list) -> list:
    failures = []
    for rec in records:
        err = _compile_one(rec)
        if err is not None:
            failures.append({"kernel": f"{rec['module']}.{rec['name']}",
                             "args": {k: v[1] for k, v in rec["args"].items()
                                      if v[0] != "ptr"},
                             "num_warps": rec["num_warps"], "where": rec.get("where", []),
                             "error": err})
    return failures


def _checker_main(path: str) -> None:
    with open(path) as f:
        records = json.load(f)
    json.dump(_failures(records), sys.stdout)


def _serve() -> None:
    """Checker: one JSON list of records per stdin line -> one JSON list of failures per line
    on stdout; anything else written to stdout (by Python or C code) goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        out.write(json.dumps(_failures(json.loads(line))) + "\n")
        out.flush()


def _checker_env() -> tuple:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env, root


def compile_launches(records: list, tmp_path) -> list:
    """Compile the records in a process without TRITON_INTERPRET; returns the failures."""
    path = os.path.join(str(tmp_path), "launches.json")
    with open(path, "w") as f:
        json.dump(records, f)
    env, root = _checker_env()
    res = subprocess.run([sys.executable, "-m", "parity_tests.triton_compile_check", path],
                         capture_output=True, text=True, env=env, cwd=root, timeout=1500)
    if res.returncode != 0:
        raise RuntimeError(f"compile checker failed: {res.stderr[-3000:]}")
    return json.loads(res.stdout)


class Checker:
    """compile_launches in one checker process kept across calls (e.g. a module-scoped
    fixture): the interpreter start and the imports of torch, Triton and the kernel modules
    (~1.5 s a process) are paid once, not per call. Each compile is still a fresh
    ASTSource / MLIR context, as in the one-shot checker. A checker that died or timed out
    fails that call with its stderr and is started again by the next."""

    def __init__(self, timeout: float = 1500):
        self.timeout = timeout
        self._proc = self._err = None

    def compile(self, records: list) -> list:
        import select
        import tempfile

        if self._proc is None or self._proc.poll() is not None:
            self.close()
            env, root = _checker_env()
            self._err = tempfile.TemporaryFile()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "parity_tests.triton_compile_check", "--serve"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                env=env, cwd=root)
        try:
            self._proc.stdin.write(json.dumps(records) + "\n")
            self._proc.stdin.flush()
            ready = select.select([self._proc.stdout], [], [], self.timeout)[0]
            line = self._proc.stdout.readline() if ready else ""
        except BrokenPipeError:
            ready, line = True, ""
        if not line:
            self._err.seek(0)
            err = self._err.read().decode(errors="replace")[-3000:]
            self.close()
            raise RuntimeError(f"compile checker {'died' if ready else 'timed out'}: {err}")
        return json.loads(line)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        if self._err is not None:
            self._err.close()
        self._proc = self._err = None


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _serve()
    else:
        _checker_main(sys.argv[1])
