"""Weights across frameworks: torch-named state dicts <-> Flax NNX modules (never imports torch).

fla_jax modules name and shape every parameter exactly as the fla_torch module with the same
constructor arguments does (Linear weights are [out, in], conv weights [D, 1, W], ...), so a
state dict maps onto a module path for path: the NNX attribute path ('gk_proj', 0, 'weight')
is the torch key 'gk_proj.0.weight'. A module shared under two names (LinearAttention with
tie_feature_map_qk) appears under both names, as in torch's state_dict.

    sd = {k: v.detach().cpu().numpy() for k, v in torch_layer.state_dict().items()}
    from_state_dict(jax_layer, sd)            # or fla_torch.interop.to_numpy(torch_layer)
    sd2 = to_state_dict(jax_layer)            # {torch name: numpy array}
    save_safetensors(jax_layer, "w.safetensors"); load_safetensors(jax_layer, "w.safetensors")
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx


class IncompatibleKeys(NamedTuple):
    missing_keys: list
    unexpected_keys: list


def named_parameters(module: nnx.Module, prefix: str = ""):
    """Yield (torch-style name, nnx.Param) for every parameter, shared ones under every name,
    in attribute order."""
    seen_path = set()

    def walk(node, name):
        if isinstance(node, nnx.Param):
            yield name, node
            return
        if isinstance(node, nnx.List) or isinstance(node, (list, tuple)):
            for i, child in enumerate(node):
                yield from walk(child, f"{name}.{i}" if name else str(i))
            return
        if isinstance(node, nnx.Module):
            if id(node) in seen_path:      # a cycle, not a shared sibling
                return
            seen_path.add(id(node))
            for attr, child in vars(node).items():
                if attr.startswith("_"):
                    continue
                yield from walk(child, f"{name}.{attr}" if name else attr)
            seen_path.discard(id(node))

    yield from walk(module, prefix)


def to_state_dict(module: nnx.Module) -> dict:
    """{torch parameter name: numpy array in the parameter's stored dtype} (bfloat16 arrays
    use ml_dtypes.bfloat16, which safetensors and torch.from_numpy-via-view understand)."""
    return {name: np.asarray(param[...]) for name, param in named_parameters(module)}


def from_state_dict(module: nnx.Module, state_dict, strict: bool = True) -> IncompatibleKeys:
    """Load {torch name: array-like} into `module` in place (numpy arrays, or anything
    np.asarray takes). Each value is cast to the parameter's storage dtype (`param_dtype`),
    as torch's load_state_dict copies into the existing parameter; shapes must match exactly.

    strict=True raises KeyError listing missing and unexpected keys (before anything is
    loaded); strict=False loads what matches and returns them."""
    params = dict(named_parameters(module))
    missing = [k for k in params if k not in state_dict]
    unexpected = [k for k in state_dict if k not in params]
    if strict and (missing or unexpected):
        raise KeyError(f"from_state_dict({type(module).__name__}): missing keys {missing}; "
                       f"unexpected keys {unexpected}")
    updates = []
    for name, param in params.items():
        if name not in state_dict:
            continue
        value = np.asarray(state_dict[name])
        current = param[...]
        if tuple(value.shape) != tuple(current.shape):
            raise ValueError(f"from_state_dict({type(module).__name__}): {name} has shape "
                             f"{list(value.shape)}; expected {list(current.shape)}")
        if not np.issubdtype(value.dtype, np.floating) and value.dtype.kind != "V" \
                and str(value.dtype) != "bfloat16":
            raise TypeError(f"from_state_dict({type(module).__name__}): {name} has dtype "
                            f"{value.dtype}; expected a floating dtype")
        updates.append((param, jnp.asarray(value).astype(current.dtype)))
    for param, value in updates:
        param.set_value(value)
    return IncompatibleKeys(missing, unexpected)


def save_safetensors(module: nnx.Module, path, metadata: dict | None = None) -> None:
    """Write `to_state_dict(module)` to a .safetensors file (torch names; readable by
    fla_torch.interop.load_safetensors and safetensors.torch.load_file)."""
    from safetensors.numpy import save_file
    arrays = {k: np.ascontiguousarray(v) for k, v in to_state_dict(module).items()}
    save_file(arrays, str(path), metadata=metadata)


def load_safetensors(module: nnx.Module, path, strict: bool = True) -> IncompatibleKeys:
    """Load a .safetensors file of torch-named tensors into `module` (see from_state_dict)."""
    from safetensors.numpy import load_file
    return from_state_dict(module, load_file(str(path)), strict=strict)
