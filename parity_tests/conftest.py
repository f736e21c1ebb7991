"""Suite-wide setup: kernels run interpreted unless PARITY_DEVICE=cuda.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
"""
import os

DEVICE = os.environ.get("PARITY_DEVICE", "cpu")
if DEVICE != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # JAX's Mosaic GPU interpreter runs each warpgroup as a thread whose operations are host
    # callbacks on XLA's CPU pool (NPROC threads, else one per core): on a 2-core machine two
    # warpgroups blocked at barriers starve the third, and a kernel whose carriers both wait
    # for its memory warpgroup (mosaic_map_ws.py) hangs
    os.environ.setdefault("NPROC", "8")
    # CPU compile time dominates the suite; XLA's cheaper backend passes cut it by about a third.
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                                       "--xla_llvm_disable_expensive_passes=true")
    from parity_tests import triton_interpret_patch
    triton_interpret_patch.apply()   # bf16 tl.dot in the interpreter (triton#11584); CPU only
    # Mosaic GPU interpret mode: each warpgroup jaxpr compiled once, not per CTA (CI time;
    # parity_tests/mosaic_interpret_patch.py); CPU only
    from parity_tests import mosaic_interpret_patch
    mosaic_interpret_patch.apply()
