"""fla_torch: linear attention for PyTorch (Triton kernels, nn.Modules). Never imports jax."""
from . import dtypes, ops
from .dtypes import DtypePolicy

__version__ = "0.1.0"
__all__ = ["dtypes", "ops", "DtypePolicy"]
