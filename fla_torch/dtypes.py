"""The dtype contract for fla_torch (see fla_contract for the shared rules).

- q, k, v share one dtype in {bf16, fp16, fp32} (fp64 in impl='reference'/'chunked').
- gates, log-decays and beta are converted to float32 inside the op (float64 with fp64 inputs).
- recurrent states (initial and final) are float32; the output has q's dtype;
  each gradient has its input's dtype.
- fp32 matmuls run at full (IEEE) precision unless `allow_tf32()` is active.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from fla_contract import PolicySpec, TensorInfo, canonical_dtype

_TO_NAME = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8", torch.bool: "bool",
}
_FROM_NAME = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
              "fp64": torch.float64}

STATE_DTYPE = torch.float32
_FP32_PRECISION = ["ieee"]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bf16'; non-float dtypes keep torch's name ('int32', 'bool', ...)."""
    return _TO_NAME.get(dtype, str(dtype).replace("torch.", ""))


def to_dtype(name) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16."""
    if isinstance(name, torch.dtype):
        return name
    return _FROM_NAME[canonical_dtype(name)]


def info(name: str, t, op: str = "") -> TensorInfo | None:
    """Describe a tensor for fla_contract.validate_op (None stays None); `op` names the op in
    the error for a non-tensor."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        given = repr(t) if len(repr(t)) <= 60 else repr(t)[:57] + "..."
        fix = (f"torch.tensor({name}, dtype=torch.int32, device=q.device)"
               if name == "cu_seqlens" else f"torch.as_tensor({name})")
        raise TypeError(f"{op + ': ' if op else ''}{name} is a {type(t).__name__} ({given}); "
                        f"expected a torch.Tensor: pass {fix}")
    return TensorInfo(name, tuple(t.shape), dtype_name(t.dtype))


def gate_dtype(activation: torch.dtype) -> torch.dtype:
    """Gates/decays/beta/states are computed in fp32, or fp64 for fp64 activations."""
    return torch.float64 if activation == torch.float64 else torch.float32


def fp32_matmul_precision() -> str:
    """'ieee' (default) or 'tf32' (inside `allow_tf32()`)."""
    return _FP32_PRECISION[-1]


@contextlib.contextmanager
def allow_tf32():
    """Let fp32 matmuls inside fla_torch ops use tf32 tensor cores."""
    _FP32_PRECISION.append("tf32")
    try:
        yield
    finally:
        _FP32_PRECISION.pop()


@dataclass(frozen=True)
class DtypePolicy:
    """Parameters stored in `param_dtype`, computed in `compute_dtype`, returned in `output_dtype`.

    `DtypePolicy.parse("bf16")` or `DtypePolicy.parse("params=fp32,compute=bf16,output=fp32")`;
    the same strings mean the same policy in fla_jax.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32

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

    def cast_to_compute(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.compute_dtype)

    def cast_to_output(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.output_dtype)

    def cast_to_param(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.param_dtype)
