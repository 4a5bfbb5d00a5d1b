"""Error helpers: every validation error names the field, the value, the rule and the fix.

`InvalidArgument` carries them as attributes, so a caller that must react to one (the collector dropping a prompt,
the server's 400 naming its parameter, the CLI's per-line errors) reads them instead of parsing the message.
"""

from __future__ import annotations

import contextlib
import logging

LOG = logging.getLogger("rollout")
PREVIEW_CHARS = 60  # longest value an error message shows in full


class InvalidArgument(ValueError):
    """A value refused before anything ran. `field`: its name (dotted for nested fields); `value`: what was given
    (as the message shows it); `rule`: what it must be; `fix`: what to do; `where`: where in a call it sits
    ("prompt 3", "pair 0", "" for a config); `index`: that prompt's or row's index, or None."""

    def __init__(self, field: str, value: object, rule: str, fix: str, where: str = "",
                 index: int | None = None) -> None:
        self.field, self.value, self.rule, self.fix, self.where, self.index = field, value, rule, fix, where, index
        super().__init__(f"{where}: {self.detail}" if where else self.detail)

    @property
    def detail(self) -> str:
        """The message without its location: `field=value is invalid: rule. Fix: fix.`"""
        return f"{self.field}={self.value!r} is invalid: {self.rule}. Fix: {self.fix}."

    def __reduce__(self):  # crosses processes (Ray actors) with its attributes
        return InvalidArgument, (self.field, self.value, self.rule, self.fix, self.where, self.index)


def invalid(field: str, value: object, rule: str, fix: str, where: str = "", index: int | None = None
            ) -> InvalidArgument:
    """Build the error every config and request check raises.

    `where` locates the value in a call (e.g. "prompt 3"), so a user can find it in a large batch; `index` is that
    position as a number, for code.
    """
    return InvalidArgument(field, value, rule, fix, where, index)


def check_int(name: str, value: object, minimum: int, fix: str, maximum: int | None = None) -> None:
    """An int (not a bool) >= minimum (and <= maximum when given), or the ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or \
            (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise invalid(name, value, f"must be an integer {bounds}", fix)


class Preview(str):
    """A value's repr, cut to PREVIEW_CHARS. Its own repr is itself, so `invalid(field, preview(v), ...)` and
    f"{preview(v)}" both show the value's repr once (a prompt of text shows as 'text', a list as [1, 2])."""

    def __repr__(self) -> str:
        return str(self)


def preview(value: object) -> Preview:
    """What an error message shows of a value that may be huge (a prompt, a record, a list of ids)."""
    text = repr(value)
    return Preview(text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "...")


@contextlib.contextmanager
def logged(what: str, level: int = logging.DEBUG):
    """Best-effort cleanup: an `Exception` raised inside (killing an actor that is already gone, stopping an engine
    thread that died) is logged on the "rollout" logger as `what` failed, and not raised. A KeyboardInterrupt or
    SystemExit goes through."""
    try:
        yield
    except Exception as error:  # noqa: BLE001
        LOG.log(level, "rollout: %s failed (%s: %s); carrying on", what, type(error).__name__, error)
