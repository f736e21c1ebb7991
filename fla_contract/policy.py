"""Mixed-precision policy strings, parsed the same way in both frameworks.

Forms accepted (case-insensitive, spaces ignored):
  "bf16"                                   -> params, compute and output all bf16
  "params=fp32,compute=bf16,output=bf16"   -> each field named (p=, c=, o= also work)
  "params=fp32,compute=fp16"               -> output defaults to the compute dtype
A field left out of the named form takes: params -> fp32, compute -> params, output -> compute.
"""
from __future__ import annotations

from dataclasses import dataclass

from .names import canonical_dtype

_FIELDS = {"params": "param", "param": "param", "p": "param",
           "compute": "compute", "c": "compute",
           "output": "output", "out": "output", "o": "output"}


@dataclass(frozen=True)
class PolicySpec:
    """param / compute / output dtypes as canonical names ('bf16', 'fp16', 'fp32', 'fp64')."""

    param: str = "fp32"
    compute: str = "fp32"
    output: str = "fp32"

    @classmethod
    def parse(cls, text: str) -> "PolicySpec":
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"policy: got {text!r}; expected a dtype name such as 'bf16' or "
                             f"'params=fp32,compute=bf16,output=bf16'")
        body = text.replace(" ", "").lower()
        if "=" not in body:
            d = canonical_dtype(body)
            return cls(d, d, d)
        found: dict[str, str] = {}
        for part in body.split(","):
            if not part:
                continue
            if "=" not in part:
                raise ValueError(f"policy: part {part!r} of {text!r} is not of the form field=dtype")
            key, value = part.split("=", 1)
            if key not in _FIELDS:
                raise ValueError(f"policy: unknown field {key!r} in {text!r}; expected params, "
                                 f"compute or output")
            field = _FIELDS[key]
            if field in found:
                raise ValueError(f"policy: field {field!r} given twice in {text!r}")
            found[field] = canonical_dtype(value)
        param = found.get("param", "fp32")
        compute = found.get("compute", param)
        output = found.get("output", compute)
        return cls(param, compute, output)

    def __str__(self) -> str:
        return f"params={self.param},compute={self.compute},output={self.output}"
