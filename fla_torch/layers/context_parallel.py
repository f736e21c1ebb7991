"""Context parallelism for the layers: inside `context_parallel(axis)` (traced inside a
`torch.distributed` process group whose ranks each hold one slice of the sequence,
rank r holding tokens [r T, (r + 1) T)), every chunk-mode op call of a layer runs with
`cp_group=group` (fla_torch/ops/common/context_parallel.py), so the recurrent state crosses
the ranks and each rank gets its slice of the single-device output.

What crosses a slice boundary only through the op is split correctly; the rest is refused
with a ValueError rather than computed per slice: short convolutions (their window reaches
into the previous slice; build layers with use_short_conv=False), softmax Attention,
recurrent mode / caches (decoding), and padding masks in MultiScaleRetention (its rotary
positions count real tokens across slices). Rotary positions of unpadded rows start at
`slice_start(T)`. Token-local parts (projections, norms, gates, the MLP,
the LM head and loss) need nothing. Mirror: fla_jax/layers/context_parallel.py (cp_mesh_axis).
"""
from __future__ import annotations

import contextlib

_GROUP: list = [None]


@contextlib.contextmanager
def context_parallel(group):
    """Layers' op calls inside take cp_group=group (a torch.distributed ProcessGroup)."""
    previous, _GROUP[0] = _GROUP[0], group
    try:
        yield group
    finally:
        _GROUP[0] = previous


def active():
    """The process group of the enclosing context_parallel, or None."""
    return _GROUP[0]


def refuse(layer: str, what: str):
    """ValueError inside context_parallel: `what` would be computed per slice (wrong)."""
    if _GROUP[0] is not None:
        raise ValueError(f"{layer}: {what} under context parallelism (cp_group="
                         f"{_GROUP[0]!r}) is not supported: it would see one slice of the "
                         f"sequence only")


def op_kwargs(family: str, mode: str) -> dict:
    """{'cp_group': group} for a chunk-mode op inside context_parallel, else {}."""
    if _GROUP[0] is None:
        return {}
    if mode != "chunk":
        refuse(family, f"mode={mode!r} (recurrent mode / decoding with a cache)")
    return {"cp_group": _GROUP[0]}


def slice_start(T: int) -> int:
    """The global position of this rank's first token inside context_parallel
    (group rank * T), else 0."""
    if _GROUP[0] is None:
        return 0
    import torch.distributed as dist
    return dist.get_rank(_GROUP[0]) * T
