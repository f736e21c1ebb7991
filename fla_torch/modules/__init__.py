"""Building blocks of the layers (FLA's names): ShortConvolution, RMSNorm, FusedRMSNormGated,
GroupNorm, LoRA."""
from .group_norm import GroupNorm
from .lora import LoRA
from .norm import FusedRMSNormGated, RMSNorm
from .short_conv import ShortConvolution

__all__ = ["ShortConvolution", "RMSNorm", "FusedRMSNormGated", "GroupNorm", "LoRA"]
