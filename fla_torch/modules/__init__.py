"""Building blocks of the layers (FLA's names): ShortConvolution, RMSNorm, FusedRMSNormGated."""
from .norm import FusedRMSNormGated, RMSNorm
from .short_conv import ShortConvolution

__all__ = ["ShortConvolution", "RMSNorm", "FusedRMSNormGated"]
