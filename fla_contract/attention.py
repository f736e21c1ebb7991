"""Softmax attention's non-tensor arguments, checked the same way in both frameworks.

Positions: query i of T sits at absolute position i + S - T among the S keys (queries are the
last T tokens; FlashAttention's bottom-right alignment), so T == S is ordinary self-attention
and T == 1 < S is one decoding step against a KV cache.

window_size follows FlashAttention: a (left, right) pair, query at position p attends keys
p - left .. p + right, -1 meaning unbounded on that side; or an int w (FLA's `Attention` layer
convention): the w most recent keys including the query's own, = (w - 1, 0).
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple

from .validate import Dims


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_window(op: str, window_size, causal) -> Optional[Tuple[int, int]]:
    """window_size -> (left, right) with -1 = unbounded, or None when it restricts nothing."""
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal is {type(causal).__name__} {causal!r}; expected True or "
                        f"False")
    if window_size is None:
        return None
    if _is_int(window_size):
        if window_size < 1:
            raise ValueError(f"{op}: window_size={window_size}; expected an int >= 1 (the w most "
                             f"recent keys, the query's own included) or a (left, right) pair")
        left, right = int(window_size) - 1, 0
    elif (isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(_is_int(w) for w in window_size)):
        left, right = (int(w) for w in window_size)
        for side, w in (("left", left), ("right", right)):
            if w < -1:
                raise ValueError(f"{op}: window_size={tuple(window_size)} has {side}={w}; "
                                 f"expected -1 (unbounded) or >= 0")
    else:
        raise TypeError(f"{op}: window_size is {type(window_size).__name__} {window_size!r}; "
                        f"expected None, an int w >= 1 or a (left, right) pair of ints "
                        f"(FlashAttention's convention, -1 = unbounded)")
    if causal:
        right = 0
    if left == -1 and right in (-1, 0 if causal else -1):
        return None
    return left, right


def check_lengths(op: str, dims: Dims, causal: bool) -> None:
    """A causal query needs a key at or before its position: S >= T."""
    T, S = dims.sizes["T"], dims.sizes["S"]
    if causal and S < T:
        raise ValueError(f"{op}: q has T={T} tokens and k/v have S={S}; expected S >= T with "
                         f"causal=True (queries are the last T of the S positions)")
