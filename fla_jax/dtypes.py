"""The dtype contract for fla_jax (see fla_contract for the shared rules).

- q, k, v share one dtype in {bf16, fp16, fp32} (fp64 in impl='reference'/'chunked' with x64).
- gates, log-decays and beta are converted to float32 inside the op (float64 with fp64 inputs).
- recurrent states (initial and final) are float32; the output has q's dtype;
  each gradient has its input's dtype.
- fp32 matmuls run at full (IEEE) precision unless `allow_tf32()` is active.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from fla_contract import PolicySpec, TensorInfo, canonical_dtype

_FROM_NAME = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32,
              "fp64": jnp.float64}
_TO_NAME = {np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "fp16",
            np.dtype(jnp.float32): "fp32", np.dtype(jnp.float64): "fp64"}

STATE_DTYPE = jnp.float32
_FP32_PRECISION = ["ieee"]


def dtype_name(dtype) -> str:
    """jnp.bfloat16 -> 'bf16'; non-float dtypes keep numpy's name ('int32', 'bool', ...)."""
    d = np.dtype(dtype)
    return _TO_NAME.get(d, d.name)


def to_dtype(name):
    """'bf16' / 'bfloat16' / jnp.bfloat16 -> jnp.bfloat16."""
    if not isinstance(name, str):
        return np.dtype(name).type if np.dtype(name) not in _TO_NAME else \
            _FROM_NAME[_TO_NAME[np.dtype(name)]]
    return _FROM_NAME[canonical_dtype(name)]


def info(name: str, x, op: str = "") -> TensorInfo | None:
    """Describe an array (concrete or traced; jax or numpy) for fla_contract.validate_op;
    `op` names the op in the error for a non-array."""
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        given = repr(x) if len(repr(x)) <= 60 else repr(x)[:57] + "..."
        fix = (f"jnp.asarray({name}, dtype=jnp.int32)" if name == "cu_seqlens"
               else f"jnp.asarray({name})")
        raise TypeError(f"{op + ': ' if op else ''}{name} is a {type(x).__name__} ({given}); "
                        f"expected a jax.Array or a numpy array: pass {fix}")
    return TensorInfo(name, tuple(x.shape), dtype_name(x.dtype))


def gate_dtype(activation):
    """Gates/decays/beta/states are computed in fp32, or fp64 for fp64 activations."""
    return jnp.float64 if np.dtype(activation) == np.dtype(jnp.float64) else jnp.float32


def fp32_matmul_precision() -> str:
    """'ieee' (default) or 'tf32' (inside `allow_tf32()`)."""
    return _FP32_PRECISION[-1]


def matmul_precision():
    """The lax precision for matmuls in chunked/reference code under the current setting."""
    if fp32_matmul_precision() == "ieee":
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


@contextlib.contextmanager
def allow_tf32():
    """Let fp32 matmuls inside fla_jax ops use tf32 (read when a function is traced)."""
    _FP32_PRECISION.append("tf32")
    try:
        yield
    finally:
        _FP32_PRECISION.pop()


@dataclass(frozen=True)
class DtypePolicy:
    """Parameters stored in `param_dtype`, computed in `compute_dtype`, returned in `output_dtype`.

    `DtypePolicy.parse("bf16")` or `DtypePolicy.parse("params=fp32,compute=bf16,output=fp32")`;
    the same strings mean the same policy in fla_torch.
    """

    param_dtype: type = jnp.float32
    compute_dtype: type = jnp.float32
    output_dtype: type = jnp.float32

    @classmethod
    def parse(cls, text) -> "DtypePolicy":
        if isinstance(text, DtypePolicy):
            return text
        spec = PolicySpec.parse(text)
        return cls(to_dtype(spec.param), to_dtype(spec.compute), to_dtype(spec.output))

    @property
    def spec(self) -> PolicySpec:
        return PolicySpec(dtype_name(self.param_dtype), dtype_name(self.compute_dtype),
                          dtype_name(self.output_dtype))

    def __str__(self) -> str:
        return str(self.spec)

    def cast_to_compute(self, x):
        return x.astype(self.compute_dtype)

    def cast_to_output(self, x):
        return x.astype(self.output_dtype)

    def cast_to_param(self, x):
        return x.astype(self.param_dtype)
