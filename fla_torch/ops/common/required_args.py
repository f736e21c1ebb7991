"""Named errors for arguments an op family cannot run without (gla's g, delta rule's beta)."""
from __future__ import annotations


def require(op: str, name: str, value, expected: str) -> None:
    """Raise TypeError naming `name` when it is None."""
    if value is None:
        raise TypeError(f"{op}: {name} is None; expected {expected} (this op requires it)")
