"""Framework-free statement of the dtype and shape contract.

Both `fla_jax` and `fla_torch` describe their tensors to these functions as
(name, shape, dtype-name) triples, so the two frameworks raise the same errors
with the same words. Each op's tensors are described once, in `op_spec.OPS`.
Nothing here imports jax or torch.
"""
from .names import (ACTIVATION_DTYPES, KERNEL_DTYPES, canonical_dtype, is_float_name,
                    pretty)
from .op_spec import OPS, ArgSpec, OpSpec
from .policy import PolicySpec
from .validate import (Dims, TensorInfo, check_cu_seqlens_values, check_head_dims,
                       check_scale, missing_arg_error, state_parts, validate_op)

__all__ = [
    "ACTIVATION_DTYPES", "KERNEL_DTYPES", "canonical_dtype", "is_float_name", "pretty",
    "PolicySpec", "Dims", "TensorInfo", "validate_op", "check_cu_seqlens_values",
    "check_head_dims", "check_scale", "missing_arg_error", "state_parts", "OPS", "OpSpec",
    "ArgSpec",
]
