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
    from parity_tests import CPU_XLA_FLAGS
    os.environ.setdefault("XLA_FLAGS", CPU_XLA_FLAGS)   # compile time dominates: see there
    from parity_tests import triton_interpret_patch
    triton_interpret_patch.apply()   # bf16 tl.dot in the interpreter (triton#11584); CPU only
    # Mosaic GPU interpret mode: each warpgroup jaxpr compiled once, not per CTA (CI time;
    # parity_tests/mosaic_interpret_patch.py); CPU only
    from parity_tests import mosaic_interpret_patch
    mosaic_interpret_patch.apply()


# Modules with the suite's longest tests (CI durations: the shared 4-device child ~100 s, the
# JAX CP worker ~50 s, Triton's sm_90 compile shards 12-24 s each, the torch process groups),
# run first. Alphabetically they came last, so `-n 2` (xdist's load scheduling hands out tests
# in collection order) ended with one worker on them while the other idled; first, the
# short tests that come after them fill both workers to the end. xdist's first chunk (a
# quarter of a worker's share) gives them all to one worker, so Triton's launch recording and
# compile checker process run in one worker, not in both. Order only: every test still runs.
SLOW_FIRST = ("test_sharding_jax_ops.py", "test_context_parallel_jax.py",
              "test_triton_compile.py", "test_sharding_torch.py",
              "test_context_parallel_torch.py")


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def pytest_collection_modifyitems(config, items):
    """SLOW_FIRST's modules first (stable: the rest keep their order; a module's tests stay
    together, so module-scoped fixtures are set up once). The JAX sharding modules share one
    4-device child (multi_device.SHARDING_MODULES): when test_sharding_jax_ops.py's parent test
    is collected it runs all three, so the other two modules' parent tests (there to run a
    module alone) are deselected."""
    from parity_tests.multi_device import SHARDING_MODULES, in_child
    if in_child():
        return
    rank = {m: i for i, m in enumerate(SLOW_FIRST)}
    items.sort(key=lambda i: rank.get(_module(i), len(SLOW_FIRST)))
    parent = "::test_on_four_devices"
    if not any(i.nodeid.endswith(SHARDING_MODULES[0] + parent) for i in items):
        return
    dup = tuple(m + parent for m in SHARDING_MODULES[1:])
    drop = [i for i in items if i.nodeid.endswith(dup)]
    if drop:
        items[:] = [i for i in items if i not in drop]
        config.hook.pytest_deselected(items=drop)
