"""Named errors for an argument an op requires (gla's g, delta rule's beta), from its OpSpec.

`run_op` checks every required argument of the op's OpSpec (fla_contract.validate_op); this
function raises the same error before run_op for callers that check early.
"""
from __future__ import annotations

from fla_contract import OPS, missing_arg_error


def require(op: str, name: str, value, expected: str | None = None) -> None:
    """Raise the contract's TypeError naming `name` when it is None; the words come from
    OPS[op] (`expected` is accepted for older callers and not used)."""
    if value is None:
        raise missing_arg_error(OPS[op], name)
