"""Error helpers: every validation error names the field, the value, the rule and the fix."""

from __future__ import annotations


def invalid(field: str, value: object, rule: str, fix: str, where: str = "") -> ValueError:
    """Build the ValueError every config and request check raises.

    `where` locates the value in a call (e.g. "prompt 3"), so a user can find it in a large batch.
    """
    prefix = f"{where}: " if where else ""
    return ValueError(f"{prefix}{field}={value!r} is invalid: {rule}. Fix: {fix}.")
