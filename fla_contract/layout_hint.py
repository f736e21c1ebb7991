"""Name the old head-first layout ([B, H, T, D]) in a shape error when it explains the error.

Used only on the error path of `validate_op`: it never refuses an input by itself. Tensors
whose OpSpec shape is [B, T, H(V), ...] are candidates; the hint is given when swapping axes 1
and 2 of some of them (the fewest) makes every shape consistent, so an input that is wrong in
another way gets no hint, and a valid input never reaches this code.
"""
from __future__ import annotations

import itertools
from typing import Callable, Mapping

from .op_spec import OpSpec


def _head_first(shape: tuple) -> bool:
    return len(shape) >= 3 and shape[:3] in (("B", "T", "H"), ("B", "T", "HV"))


def _swapped(t):
    shape = list(t.shape)
    shape[1], shape[2] = shape[2], shape[1]
    return type(t)(t.name, tuple(shape), t.dtype)


def head_first_hint(spec: OpSpec, given: Mapping, consistent: Callable[[dict], bool]) -> str:
    """'' or a sentence for the error: which tensors look head-first and how to fix them.

    given: name -> TensorInfo; consistent(tensors) -> True when validation passes."""
    candidates = [a for a in spec.args if _head_first(a.shape) and a.name in given
                  and len(given[a.name].shape) == len(a.shape)]

    def explains(chosen) -> bool:
        trial = dict(given)
        for a in chosen:
            trial[a.name] = _swapped(given[a.name])
        return bool(chosen) and consistent(trial)

    for n in range(1, len(candidates) + 1):
        for chosen in itertools.combinations(candidates, n):
            if not explains(chosen):
                continue
            rest = tuple(a for a in candidates if a not in chosen)
            names = ", ".join(a.name for a in chosen)
            if explains(rest):   # the shapes cannot tell which side has time first
                return (f". Either {names} or {', '.join(a.name for a in rest)} look like the "
                        f"head-first layout {_layouts(chosen + rest)}" + _FIX)
            verb = "looks" if n == 1 else "look"
            return f". {names} {verb} like the head-first layout {_layouts(chosen)}" + _FIX
    return ""


_FIX = ("; this op takes time before heads ([B, T, H, ...]): swap axes 1 and 2 "
        "(torch: x.transpose(1, 2); JAX: jnp.swapaxes(x, 1, 2))")


def _layouts(args) -> str:
    seen = []
    for a in args:
        lay = "[" + ", ".join((a.shape[0], a.shape[2], a.shape[1]) + a.shape[3:]) + "]"
        if lay not in seen:
            seen.append(lay)
    return ", ".join(seen)
