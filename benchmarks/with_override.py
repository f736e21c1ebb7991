"""Run a module (`python -m <module> args...`) with module constants overridden for the whole
process, in pallas_launch_sweep.py's variant syntax (`<module>:NAME=value[,...]`, ';'-joined),
e.g. GPU parity of an opt-in backward:

    python benchmarks/with_override.py "fla_jax.ops.simple_gla.mosaic_chunk:BACKWARD=mosaic" \\
        -m parity_tests --device cuda --impls mosaic --ops chunk_simple_gla
"""
from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: with_override.py '<module>:NAME=value' -m <module> [args...]")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]      # pallas_launch_sweep, the repo root
    from pallas_launch_sweep import Override, parse_variant
    spec, module, rest = argv[0], argv[2], argv[3:]
    with Override(parse_variant(spec)):
        sys.argv = [module] + rest
        runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
