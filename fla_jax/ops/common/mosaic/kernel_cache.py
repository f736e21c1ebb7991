"""One compile per kernel per process. Mosaic GPU compiles a kernel once per module hash (jaxlib's
custom call caches compiled kernels by the SHA-256 of the module), but jax 0.11's lowering
stamps every module it lowers with a fresh `mosaic_gpu.dump_basename` (the module name plus a
process-wide counter, to name dump files), so the same kernel lowered twice -- the forward's
kernels again in the training step's program, any second jit around the op -- hashes anew and
is compiled again (H200: 0.5-1.7 s a kernel; `benchmarks/kernel_compile_time.py`).

`keep_hash_stable(name)` registers a kernel name of this library; for those modules alone the
stamp is dropped right after it is set, unless Mosaic dumps were asked for (MOSAIC_GPU_DUMP_*:
then the dump files keep their distinct names). Other libraries' kernels are left as they are.
Where the lowering does not stamp (jax 0.10), nothing is installed.
"""
from __future__ import annotations

STAMP = "mosaic_gpu.dump_basename"
_OURS: set[str] = set()
_INSTALLED = [False]
_DUMP_FLAGS = ("mlir_passes", "ptx", "ptxas", "sass", "sass_ctrl", "resources",
               "constraint_system")


def _dumping(opts) -> bool:
    return any(bool(getattr(opts, f, False)) for f in _DUMP_FLAGS)


def _module_name(module):
    attrs = module.operation.attributes
    if "sym_name" not in attrs:
        return None
    from jax._src.lib.mlir import ir
    return ir.StringAttr(attrs["sym_name"]).value


def _install() -> None:
    if _INSTALLED[0]:
        return
    _INSTALLED[0] = True
    try:
        from jax.experimental.mosaic.gpu import dialect
    except ImportError:      # no Mosaic GPU in this jax: nothing lowers, nothing to keep
        return
    stamp = getattr(dialect, "get_or_set_dump_options", None)
    if stamp is None:        # jax < 0.11 does not stamp modules
        return

    def get_or_set_dump_options(module):
        opts = stamp(module)
        attrs = module.operation.attributes
        if STAMP in attrs and not _dumping(opts) and _module_name(module) in _OURS:
            del attrs[STAMP]
        return opts
    get_or_set_dump_options.__wrapped__ = stamp
    dialect.get_or_set_dump_options = get_or_set_dump_options


def is_ours(name) -> bool:
    """A kernel of this library (registered by `keep_hash_stable`, i.e. built by tiles.build):
    the one registry compile_ahead.py and lowering_cache.py read too."""
    return name in _OURS


def keep_hash_stable(name: str) -> None:
    """Lowerings of the kernel `name` (its module's name) hash alike: compiled once per process."""
    _OURS.add(name)
    _install()
