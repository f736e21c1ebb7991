"""Context parallelism for the layers: inside `context_parallel(axis)` (traced inside a
`jax.shard_map` that holds each device's slice of the sequence along mesh axis `axis`,
device r holding tokens [r T, (r + 1) T)), every chunk-mode op call of a layer runs with
`cp_mesh_axis=axis` (fla_jax/ops/common/context_parallel.py), so the recurrent state crosses
the devices and each device gets its slice of the single-device output.

What crosses a slice boundary only through the op is split correctly; the rest is refused
with a ValueError rather than computed per slice: short convolutions (their window reaches
into the previous slice; build layers with use_short_conv=False), softmax Attention,
recurrent mode / caches (decoding), and padding masks in MultiScaleRetention (its rotary
positions count real tokens across slices). Rotary positions of unpadded rows start at
`slice_start(T)`. Token-local parts (projections, norms, gates, the MLP,
the LM head and loss) need nothing. Mirror: fla_torch/layers/context_parallel.py (cp_group).
"""
from __future__ import annotations

import contextlib

_AXIS: list = [None]


@contextlib.contextmanager
def context_parallel(axis):
    """Layers' op calls traced inside take cp_mesh_axis=axis (a mesh axis name)."""
    previous, _AXIS[0] = _AXIS[0], axis
    try:
        yield axis
    finally:
        _AXIS[0] = previous


def active():
    """The mesh axis of the enclosing context_parallel, or None."""
    return _AXIS[0]


def refuse(layer: str, what: str):
    """ValueError inside context_parallel: `what` would be computed per slice (wrong)."""
    if _AXIS[0] is not None:
        raise ValueError(f"{layer}: {what} under context parallelism (cp_mesh_axis="
                         f"{_AXIS[0]!r}) is not supported: it would see one slice of the "
                         f"sequence only")


def op_kwargs(family: str, mode: str) -> dict:
    """{'cp_mesh_axis': axis} for a chunk-mode op inside context_parallel, else {}."""
    if _AXIS[0] is None:
        return {}
    if mode != "chunk":
        refuse(family, f"mode={mode!r} (recurrent mode / decoding with a cache)")
    return {"cp_mesh_axis": _AXIS[0]}


def slice_start(T: int):
    """The global position of this device's first token inside context_parallel
    (axis_index * T, traced), else 0."""
    if _AXIS[0] is None:
        return 0
    import jax
    return jax.lax.axis_index(_AXIS[0]) * T
