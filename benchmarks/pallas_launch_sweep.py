"""Whole-op time of one Pallas op per launch variant: the JAX twin of launch_sweep.py.

A variant overrides, for the length of one trace, either the launch of one engine kernel
(`launch.<kernel>:bk=..,bv=..,num_warps=..,num_stages=..`, kernel one of
fla_jax.ops.common.engine.launch.KERNELS: every engine module's `launch_for` answers the
override for that kernel), the delta family's tiles (`tiles:grads=32/4,dh=64/8/2`: fields of
launch.DeltaTiles, tuples written with '/', for every caller of launch.delta_tiles) or module
constants (`<module>:NAME=value[,NAME=value]`, NAME.key for a dict constant's entry, module under
fla_jax.ops.common.engine, e.g. `cumsum_scores:FRAME=rows,DIAG=split`, or a full `fla_jax.`
module name). `--impl mosaic` times the op's Mosaic GPU kernels instead (Hopper). Several
parts join with ';'. Each variant is traced and compiled afresh (constants are read at trace time), the tree's
defaults first. Values: ints, None, or strings.

    PYTHONPATH=. python benchmarks/pallas_launch_sweep.py --op gla \\
        --variant "launch.cumsum_scores:bk=32" --variant "cumsum_scores:DIAG=split"
    PYTHONPATH=. python benchmarks/pallas_launch_sweep.py --dry-run --op gla --variant ...  # CPU

GPU: run.py's time_jax (wall clock, median of 15 loops of 10 calls), fwd and fwd+bwd. --dry-run:
a tiny shape, interpreted kernels, one fwd+bwd per variant, and how many launch_for answers each
override gave (0: the op never asks for that kernel's launch; an unknown kernel, module or
constant raises).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import pkgutil
import sys

ENGINE = "fla_jax.ops.common.engine"


def _value(text: str):
    """'None', 'True' / 'False', an int, a float, else the text ('False' must not stay a
    truthy string)."""
    named = {"None": None, "True": True, "False": False}
    if text in named:
        return named[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_variant(text: str) -> list:
    """'launch.k:bk=32;mod:A=x' -> [('launch', 'k', {'bk': 32}), ('const', 'mod', {'A': 'x'})]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, opts = part.partition(":")
        if not name or not opts:
            raise ValueError(f"variant {part!r}: expected 'launch.<kernel>:opt=val' or "
                             f"'<module>:NAME=val'")
        vals = {}
        for kv in opts.split(","):
            k, _, v = kv.partition("=")
            if not k or not v:
                raise ValueError(f"variant {part!r}: {kv!r} is not opt=val")
            vals[k] = _value(v)
        if name.startswith("launch."):
            out.append(("launch", name[len("launch."):], vals))
        elif name == "tiles":
            out.append(("tiles", name, vals))
        else:
            out.append(("const", name, vals))
    return out


class Override:
    """Applies one parsed variant to the engine modules; counts the launch answers it gave."""

    def __init__(self, spec):
        self.spec, self.saved, self.hits = spec, [], {}

    def __enter__(self):
        try:
            return self._apply()
        except Exception:
            self.__exit__()     # a later part that fails undoes the earlier ones
            raise

    def _apply(self):
        # every engine module, so that one the op imports only when called (KDA's, RWKV-7's
        # stages) holds the patched launch_for too
        engine = importlib.import_module(ENGINE)
        for info in pkgutil.iter_modules(engine.__path__):
            importlib.import_module(f"{ENGINE}.{info.name}")
        launch = importlib.import_module(f"{ENGINE}.launch")
        orig, orig_tiles = launch.launch_for, launch.delta_tiles
        by_kernel, tiles = {}, {}
        for kind, name, vals in self.spec:
            if kind == "tiles":
                fields = {f.name for f in dataclasses.fields(launch.DeltaTiles)}
                bad = set(vals) - fields
                if bad:
                    raise ValueError(f"tiles: {sorted(bad)} not in {sorted(fields)}")
                tiles.update({f: v if isinstance(v, int) else tuple(int(x) for x in v.split("/"))
                              for f, v in vals.items()})
                self.hits["tiles"] = 0
            elif kind == "launch":
                if name not in launch.KERNELS:
                    raise ValueError(f"launch.{name}: expected a kernel of {launch.KERNELS}")
                fields = {f.name for f in dataclasses.fields(launch.Launch)}
                bad = set(vals) - fields
                if bad:
                    raise ValueError(f"launch.{name}: {sorted(bad)} not in {sorted(fields)}")
                by_kernel[name] = vals
                self.hits[f"launch.{name}"] = 0
            else:
                mod = importlib.import_module(name if name.startswith("fla_jax.")
                                              else f"{ENGINE}.{name}")
                for const, v in vals.items():
                    const, _, key = const.partition(".")    # TUNING.ws=1: a dict's entry
                    if not hasattr(mod, const) or (key and key not in getattr(mod, const)):
                        raise ValueError(f"{name}.{const}{'.' + key if key else ''}: no such "
                                         f"constant")
                    self.saved.append((mod, const, getattr(mod, const)))
                    setattr(mod, const, {**getattr(mod, const), key: v} if key else v)

        def patched(kernel, *a, **k):
            cfg = orig(kernel, *a, **k)
            if kernel in by_kernel:
                self.hits[f"launch.{kernel}"] += 1
                cfg = dataclasses.replace(cfg, **by_kernel[kernel])
            return cfg

        def patched_tiles(*a, **k):
            self.hits["tiles"] += 1
            return dataclasses.replace(orig_tiles(*a, **k), **tiles)
        if tiles:
            self._replace("delta_tiles", orig_tiles, patched_tiles)
        if by_kernel:
            self._replace("launch_for", orig, patched)
        return self

    def _replace(self, name, orig, new):
        """Every engine module's `name` that is `orig` becomes `new` (undone by __exit__)."""
        for mname in list(sys.modules):
            mod = sys.modules[mname]
            if mname.startswith(ENGINE) and getattr(mod, name, None) is orig:
                self.saved.append((mod, name, orig))
                setattr(mod, name, new)

    def __exit__(self, *exc):
        for mod, name, v in reversed(self.saved):
            setattr(mod, name, v)
        self.saved = []


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--op", required=True)
    p.add_argument("--shape", default="B4T4096")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--variant", action="append", default=[],
                   help="'launch.<kernel>:opt=val,...' or '<module>:NAME=val', ';'-joined")
    p.add_argument("--impl", default="pallas", choices=["pallas", "mosaic"],
                   help="the op's kernels: Pallas Triton lowering, or Mosaic GPU (Hopper)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run as bench
    variants = [("default", [])] + [(v, parse_variant(v)) for v in args.variant]
    if args.dry_run:
        import jax
        s = dict(B=1, T=80, H=2, HV=2, K=32, V=32, M=16)
        x = bench.make_numpy(args.op, s)
        for name, spec in variants:
            with Override(spec) as ov:
                fwd, fb = bench.jax_case(args.op, x, args.dtype, args.impl)
                jax.block_until_ready(fb())
            print(f"dry run {args.op} {args.dtype} [{name}]: launch answers {ov.hits}", flush=True)
        return 0
    x = bench.make_numpy(args.op, bench.SHAPES[args.shape])
    print(f"{args.op} {args.dtype} {args.shape} ({args.impl}, fwd / fwd+bwd ms)", flush=True)
    for name, spec in variants:
        try:
            with Override(spec):
                fwd, fb = bench.jax_case(args.op, x, args.dtype, args.impl)
                f_ms, f_first = bench.time_jax(fwd)
                b_ms, b_first = bench.time_jax(fb)
            print(f"  [{name}] fwd {f_ms:.3f} fwd+bwd {b_ms:.3f} (first {f_first + b_first:.1f} s)",
                  flush=True)
        except Exception as e:   # a variant that fails to compile or run is reported
            print(f"  [{name}] FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
