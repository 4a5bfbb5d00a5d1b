"""FleetFuture: a submitted RolloutFleet call, as RolloutFuture is for a worker.

    future = fleet.submit(prompts, sampling=...)
    future.done(); batch = future.result(timeout=None); future.cancel()
    for group in future.as_completed():   # each prompt's group as soon as the actor running it has all its rows
    future.add_done_callback(fn)          # fn(future) once it is over, on a thread of the fleet
    future.discarded_tokens               # after a cancel: model tokens the actors sampled for groups thrown away

The call runs on one of the fleet's call threads; each group its actors stream back goes into `Groups`, in finishing
order, with the call's own prompt_index. Nothing here imports Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from ..base.batch import RolloutBatch

LOG = logging.getLogger("rollout")


class Groups:
    """A fleet call's finished groups, in finishing order, for `FleetFuture.as_completed` (put by the call's thread,
    closed when the call is over)."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.batches: list[RolloutBatch] = []
        self.closed = False
        self.changed = threading.Condition()

    def put(self, batch: RolloutBatch) -> None:
        with self.changed:
            self.batches.append(batch)
            self.changed.notify_all()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()


class CallCancel(threading.Event):
    """Set to cancel a fleet call; `reports` collects what each actor's cancel answers (the tokens it discarded, as
    a result handle the fleet resolves), and `resolve` turns a handle into its value (ray.get, given by the fleet)."""

    def __init__(self, resolve: Callable[[list, float], list]) -> None:
        super().__init__()
        self.reports: list[Any] = []
        self.resolve = resolve


class FleetFuture:
    """A submitted fleet call: `done()`, `result(timeout=None)`, `cancel()` (what the actors still run of it is
    cancelled too) and `as_completed(timeout=None)`: each prompt's group as a RolloutBatch as soon as the actor
    running it has all its rows, in finishing order, with the call's own prompt_index (as RolloutFuture's)."""

    def __init__(self, future: Future, cancel: CallCancel, groups: Groups, deadline: float | None = None,
                 timeout: float | None = None) -> None:
        self._future, self._cancel, self._groups = future, cancel, groups
        self._deadline, self._timeout = deadline, timeout  # the call's own (time.monotonic()), if it has one

    @property
    def discarded_tokens(self) -> int:
        """Model tokens the actors sampled for groups a cancel threw away (0 until cancelled; an actor that died
        meanwhile counts nothing): each actor's worker counts its own, as RolloutFuture does."""
        if not self._cancel.is_set() or not self._future.done():
            return 0
        counts = []
        try:
            counts = self._cancel.resolve(list(self._cancel.reports), 10.0)
        except Exception as error:  # noqa: BLE001  (an actor that died: its count is unknown, counted as 0)
            LOG.debug("rollout: a cancelled fleet call's discarded tokens were not all counted: %s", error)
        return int(sum(c for c in counts if isinstance(c, int)))

    def add_done_callback(self, fn: Callable[["FleetFuture"], None]) -> None:
        """fn(future) once the call is over (at once if it already is), on a thread of the fleet."""
        self._future.add_done_callback(lambda _: fn(self))

    def done(self) -> bool:
        return self._future.done()

    def cancelled(self) -> bool:
        return self._cancel.is_set() or self._future.cancelled()

    def result(self, timeout: float | None = None) -> RolloutBatch:
        """The call's batch, or what it raised. A call with its own timeout that is still queued at its deadline
        (behind the fleet's MAX_CALLS running calls) never runs: TimeoutError then, at the deadline; a running one
        raises its own TimeoutError (`RolloutFleet._scatter`)."""
        end = None if timeout is None else time.monotonic() + timeout
        if self._deadline is not None and (end is None or self._deadline < end):
            try:
                return self._future.result(max(0.0, self._deadline - time.monotonic()))
            except TimeoutError:
                if self._future.done():  # the call's own error
                    raise
                if self._future.cancel():  # still queued
                    self._groups.close()
                    raise TimeoutError(f"RolloutFleet call timed out after {self._timeout}s while queued behind the "
                                       "fleet's running calls (it never started)") from None
        return self._future.result(None if end is None else max(0.0, end - time.monotonic()))

    def as_completed(self, timeout: float | None = None) -> Iterator[RolloutBatch]:
        """Groups as they finish; then raises what `result` raises if the call failed or was cancelled. `timeout`
        bounds the whole iteration (TimeoutError; the call goes on)."""
        groups = self._groups
        deadline = None if timeout is None else time.monotonic() + timeout
        for position in range(groups.num_groups):
            with groups.changed:
                while position >= len(groups.batches):
                    if groups.closed:
                        self._future.result()  # raises the call's error (a finished call has every group)
                        raise RuntimeError("rollout bug: a fleet call ended without all its groups")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"as_completed timed out after {timeout}s with {position}/"
                                           f"{groups.num_groups} groups done")
                    groups.changed.wait(remaining)
                batch = groups.batches[position]
            yield batch

    def cancel(self) -> bool:
        if self._future.cancel():  # not started yet
            self._groups.close()
            return True
        if self._future.done():
            return False
        self._cancel.set()
        try:  # the call stops at its next batch; what it raised on the way is the cancelled call's, not the caller's
            self._future.result()
        except Exception as error:  # noqa: BLE001  (a KeyboardInterrupt or SystemExit still reaches the caller)
            LOG.debug("rollout: a cancelled fleet call ended with %s: %s", type(error).__name__, error)
        return True
