"""Shared helpers of the Pallas Mosaic GPU (sm_90, Hopper) kernels: impl='mosaic'.

Off a Hopper GPU the kernels are lowered for CUDA (export_for_cuda: checks layouts, wgmma
shapes, barriers, TMA transforms and SMEM size on a CPU machine), or run by JAX's GPU
interpret mode (tiles.gpu_interpret: simulated SMEM/TMA/barriers, exact matmuls; slow, tests
only; it checks the data flow, not register layouts). impl='mosaic' itself needs a Hopper GPU.
"""
from .dispatch import check_mosaic, mosaic_or, mosaic_proven
from .lowering import export_for_cuda, mosaic_error, on_hopper, require_hopper

__all__ = ["check_mosaic", "export_for_cuda", "mosaic_error", "mosaic_or", "mosaic_proven",
           "on_hopper", "require_hopper"]
