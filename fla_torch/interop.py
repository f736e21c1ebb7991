"""Weights across frameworks, torch side (never imports jax).

`to_numpy(module_or_state_dict)` gives {name: numpy array} for fla_jax.interop.from_state_dict
(bfloat16 tensors become ml_dtypes.bfloat16 arrays, bit for bit); `from_numpy(arrays)` turns
fla_jax.interop.to_state_dict's output back into tensors for `module.load_state_dict`.
`save_safetensors` / `load_safetensors` write and read the same files fla_jax.interop does.
"""
from __future__ import annotations

import numpy as np
import torch


def _bf16_numpy_type():
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - ml_dtypes comes with jax and safetensors users
        raise ImportError("to_numpy/from_numpy of bfloat16 tensors need the ml_dtypes package "
                          "(pip install ml_dtypes)") from e
    return ml_dtypes.bfloat16


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A detached CPU copy as numpy; bfloat16 -> ml_dtypes.bfloat16 with the same bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bf16_numpy_type()).copy()
    return t.numpy().copy()


def numpy_to_tensor(a) -> torch.Tensor:
    """numpy (or array-like) -> CPU tensor; ml_dtypes.bfloat16 -> torch.bfloat16, same bits."""
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(
            torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def to_numpy(module_or_state_dict) -> dict:
    """{state_dict key: numpy array} of an nn.Module (its state_dict) or of a state dict."""
    sd = (module_or_state_dict.state_dict() if isinstance(module_or_state_dict, torch.nn.Module)
          else module_or_state_dict)
    return {k: tensor_to_numpy(v) for k, v in sd.items()}


def from_numpy(arrays) -> dict:
    """{name: array-like} -> {name: torch.Tensor} for `module.load_state_dict(..., strict=True)`
    (load_state_dict casts into each parameter's existing dtype and device)."""
    return {k: numpy_to_tensor(v) for k, v in arrays.items()}


def save_safetensors(module: torch.nn.Module, path, metadata: dict | None = None) -> None:
    """Write module.state_dict() to a .safetensors file. Tensors shared under two names (tied
    weights) are written under each name, as fla_jax.interop does."""
    from safetensors.torch import save_file
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in module.state_dict().items()}
    save_file(tensors, str(path), metadata=metadata)


def load_safetensors(module: torch.nn.Module, path, strict: bool = True):
    """Load a .safetensors file into module (load_state_dict semantics; returns its result)."""
    from safetensors.torch import load_file
    return module.load_state_dict(load_file(str(path)), strict=strict)
