"""fla_jax: linear attention for JAX (Pallas kernels, Flax NNX modules). Never imports torch."""
from . import dtypes, ops
from .dtypes import DtypePolicy

__version__ = "0.1.0"
__all__ = ["dtypes", "ops", "DtypePolicy"]
