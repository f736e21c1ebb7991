"""Building blocks of the layers (FLA's names): ShortConvolution, RMSNorm, FusedRMSNormGated,
GroupNorm, LoRA and Linear (torch's parameter layout: weight [out, in])."""
from .group_norm import GroupNorm
from .linear import Linear
from .lora import LoRA
from .norm import FusedRMSNormGated, RMSNorm
from .short_conv import ShortConvolution

__all__ = ["Linear", "ShortConvolution", "RMSNorm", "FusedRMSNormGated", "GroupNorm", "LoRA"]
