"""Where Mosaic GPU kernels can run (`on_hopper`), and lowering them for CUDA on any machine
(`export_for_cuda`), which runs the whole Mosaic GPU lowering without a GPU."""
from __future__ import annotations

import contextlib

import jax


def on_hopper() -> bool:
    """True when JAX's default backend is a GPU of compute capability 9.x (H100/H200)."""
    if jax.default_backend() != "gpu":
        return False
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    return cc.split(".")[0] == "9"


def mosaic_error(op: str, reason: str) -> ValueError:
    """The error impl='mosaic' raises for a call its kernels cannot take."""
    return ValueError(f"{op}: impl='mosaic' cannot take this call: {reason}; use impl='pallas' "
                      f"(or impl='auto', which falls back to it)")


def require_hopper(op: str) -> None:
    """Raise a named error unless Mosaic GPU kernels can run here (a Hopper GPU), or the
    kernels are being lowered for CUDA (`export_for_cuda`) or interpreted on the CPU
    (tiles.gpu_interpret, tests only)."""
    from .tiles import interpreting
    if _LOWERING_ONLY[0] or interpreting() or on_hopper():
        return
    where = jax.default_backend()
    if where == "gpu":
        where += f" (compute capability {getattr(jax.devices()[0], 'compute_capability', '?')})"
    raise ValueError(f"{op}: impl='mosaic' needs a Hopper GPU (sm_90); the default backend "
                       f"here is {where}. Pallas Mosaic GPU kernels cannot run interpreted; use "
                       f"impl='pallas' (Triton lowering; interpreted off-GPU) or impl='auto'")


_LOWERING_ONLY = [False]
_TRITON_CALL = "__gpu$xla.gpu.triton"     # Pallas Triton-lowering kernels (no export guarantee)


@contextlib.contextmanager
def _triton_targets_hopper():
    """Without a GPU, jax >= 0.11's Pallas Triton lowering asks the local device for its compute
    capability and fails ("No supported GPU devices found"); while exporting for CUDA it is told
    an H100 (sm_90, what the Mosaic kernels beside it target). jax 0.10 needs nothing."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        yield
        return
    if jax.default_backend() == "gpu" or not hasattr(gpu_info, "get_gpu_info_from_version"):
        yield
        return
    saved = gpu_info.get_gpu_info
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    try:
        yield
    finally:
        gpu_info.get_gpu_info = saved


def export_for_cuda(fn, *shape_dtype_structs) -> str:
    """Lower `fn` for CUDA with `jax.export.export(jax.jit(fn), platforms=["cuda"])` and return
    the StableHLO module text (Mosaic GPU kernels appear as custom calls). Runs the Mosaic GPU
    lowering on any machine; raises its error where a kernel does not lower. Inside, the
    Hopper check of `require_hopper` is lifted (nothing runs), and Pallas Triton-lowering
    kernels reached from fn are built for the GPU (dispatch.compiled_for_gpu), not interpreted."""
    from ..dispatch import compiled_for_gpu
    _LOWERING_ONLY[0] = True
    try:
        with compiled_for_gpu(), _triton_targets_hopper():
            exported = jax.export.export(
                jax.jit(fn), platforms=["cuda"],
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
            )(*shape_dtype_structs)
    finally:
        _LOWERING_ONLY[0] = False
    return exported.mlir_module()
