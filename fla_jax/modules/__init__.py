"""Building blocks of the layers (FLA's names): ShortConvolution, RMSNorm, FusedRMSNormGated,
and Linear (torch's parameter layout: weight [out, in])."""
from .linear import Linear
from .norm import FusedRMSNormGated, RMSNorm
from .short_conv import ShortConvolution

__all__ = ["Linear", "ShortConvolution", "RMSNorm", "FusedRMSNormGated"]
