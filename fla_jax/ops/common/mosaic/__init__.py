"""Shared helpers of the Pallas Mosaic GPU (sm_90, Hopper) kernels: impl='mosaic'.

The Mosaic GPU kernels cannot be interpreted: off a Hopper GPU they are only lowered (to check
layouts, wgmma shapes, barriers and TMA transforms on a CPU machine), never run.
"""
from .dispatch import check_mosaic, mosaic_or, mosaic_proven
from .lowering import export_for_cuda, mosaic_error, on_hopper, require_hopper

__all__ = ["check_mosaic", "export_for_cuda", "mosaic_error", "mosaic_or", "mosaic_proven",
           "on_hopper", "require_hopper"]
