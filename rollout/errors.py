"""Error helpers: every validation error names the field, the value, the rule and the fix."""

from __future__ import annotations


def invalid(field: str, value: object, rule: str, fix: str, where: str = "") -> ValueError:
    """Build the ValueError every config and request check raises.

    `where` locates the value in a call (e.g. "prompt 3"), so a user can find it in a large batch.
    """
    prefix = f"{where}: " if where else ""
    return ValueError(f"{prefix}{field}={value!r} is invalid: {rule}. Fix: {fix}.")


def check_int(name: str, value: object, minimum: int, fix: str) -> None:
    """An int (not a bool) >= minimum, or the ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise invalid(name, value, f"must be an integer >= {minimum}", fix)
