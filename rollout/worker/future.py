"""RolloutFuture: a submitted generate call (`RolloutWorker.submit`), as concurrent.futures users expect it.

    future = worker.submit(prompts, sampling=...)   # returns at once
    future.done(); batch = future.result(timeout=None); future.cancel()
    for group in future.as_completed():             # one RolloutBatch per prompt, as soon as its n rows are back
        ...
    future.add_done_callback(fn)                    # fn(future) once it is over, on the engine's supervisor thread

`result` raises TimeoutError (the call goes on), concurrent.futures.CancelledError after a cancel, or RuntimeError
when a sample failed past the worker's retries. The batch is built once, on the first `result`.

`as_completed(timeout=None)` yields each prompt's group (its n rows, or its n episodes) in the order the groups
finish, as a RolloutBatch with the same fields as `result()`'s and the call's own `prompt_index`. The engine
announces a group where it settles its last sample (no polling); groups that finished before a cancel or a failure
are still yielded, then it raises as `result` would. It may be iterated several times (each iteration sees every
group), and `result()` still returns the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError

from ..base.batch import RolloutBatch, Row
from ..engine import Call
from ..engine.kernels import openmp


class RolloutFuture:
    def __init__(self, call: Call, cancel: Callable[[Call], None],
                 build: Callable[[list[Row]], RolloutBatch]) -> None:
        self._call, self._cancel, self._build = call, cancel, build
        self._batch: RolloutBatch | None = None

    def done(self) -> bool:
        """Over: every row is back, or the call failed or was cancelled."""
        return self._call.settled.is_set()

    def cancelled(self) -> bool:
        return self._call.cancelled

    @property
    def discarded_tokens(self) -> int:
        """Model tokens a cancel threw away: those sampled for groups that never completed (0 if not cancelled)."""
        return self._call.discarded_tokens

    def result(self, timeout: float | None = None) -> RolloutBatch:
        openmp.release_callers_pool()  # this thread waits now: its OpenMP workers would throttle the engine's
        if not self._call.settled.wait(timeout):
            raise TimeoutError(f"generate timed out after {timeout}s with {self._call.num_done()}/"
                               f"{len(self._call.samples)} rows done")
        self._raise_if_over()
        if self._batch is None:
            self._batch = self._build([r for s in self._call.samples for r in s.rows()])
        return self._batch

    def as_completed(self, timeout: float | None = None) -> Iterator[RolloutBatch]:
        """Each prompt's group as soon as it is complete, in finishing order (see the module docstring). `timeout`
        bounds the whole iteration: TimeoutError once it passes with groups still running (the call goes on)."""
        openmp.release_callers_pool()  # as in result()
        call = self._call
        deadline = None if timeout is None else time.monotonic() + timeout
        by_prompt: dict[int, list] = {}
        for sample in call.samples:
            by_prompt.setdefault(sample.prompt_index, []).append(sample)
        for position in range(call.num_groups):
            with call.changed:
                while True:
                    over = call.cancelled or call.failure is not None  # read first: a group completed before a
                    if position < len(call.completed):                # cancel is always already listed
                        prompt_index = call.completed[position]
                        break
                    if over:
                        self._raise_if_over()
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"as_completed timed out after {timeout}s with {position}/"
                                           f"{call.num_groups} groups done")
                    call.changed.wait(remaining)
            yield self._build([r for s in by_prompt[prompt_index] for r in s.rows()])

    def _raise_if_over(self) -> None:
        if self._call.cancelled:
            raise CancelledError("this rollout was cancelled")
        if self._call.failure is not None:
            raise RuntimeError(self._call.failure)

    def add_done_callback(self, fn: Callable[["RolloutFuture"], None]) -> None:
        """Call `fn(future)` once the call is over (at once if it is): on the engine's supervisor thread, so it must
        return quickly and not wait on the worker (hand the future to another thread or event loop)."""
        self._call.add_done_callback(lambda: fn(self))

    def cancel(self) -> bool:
        """Stop what is left of the call (nothing of it keeps running); False if it was already over."""
        if self.done():
            return False
        self._cancel(self._call)
        self._call.settled.wait()
        return self._call.cancelled
