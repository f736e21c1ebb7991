"""Canonical dtype names shared by both frameworks."""

# dtypes that q/k/v may have in a kernel implementation
KERNEL_DTYPES = ("bf16", "fp16", "fp32")
# dtypes that q/k/v may have in the reference / chunked implementations
ACTIVATION_DTYPES = ("bf16", "fp16", "fp32", "fp64")
FLOAT_NAMES = ("bf16", "fp16", "fp32", "fp64")
INT_NAMES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")

_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "f16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "f32": "fp32", "float32": "fp32", "float": "fp32", "single": "fp32",
    "fp64": "fp64", "f64": "fp64", "float64": "fp64", "double": "fp64",
}

_PRETTY = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def canonical_dtype(name: str) -> str:
    """Map a user spelling ('bfloat16', 'half', 'f32', ...) to 'bf16' | 'fp16' | 'fp32' | 'fp64'."""
    key = str(name).strip().lower()
    for prefix in ("torch.", "jnp.", "np.", "numpy."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    if key not in _ALIASES:
        raise ValueError(
            f"dtype: got {name!r}; expected one of bf16/bfloat16, fp16/float16/half, "
            f"fp32/float32, fp64/float64")
    return _ALIASES[key]


def is_float_name(name: str) -> bool:
    return name in FLOAT_NAMES


def pretty(name: str) -> str:
    """'bf16' -> 'bfloat16' for messages; other names unchanged."""
    return _PRETTY.get(name, name)
