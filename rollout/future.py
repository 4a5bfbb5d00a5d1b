"""RolloutFuture: a submitted generate call (`RolloutWorker.submit`), as concurrent.futures users expect it.

    future = worker.submit(prompts, sampling=...)   # returns at once
    future.done(); batch = future.result(timeout=None); future.cancel()
    future.add_done_callback(fn)                    # fn(future) once it is over, on the engine's supervisor thread

`result` raises TimeoutError (the call goes on), concurrent.futures.CancelledError after a cancel, or RuntimeError
when a sample failed past the worker's retries. The batch is built once, on the first `result`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import CancelledError

from .batch import RolloutBatch
from .engine import Call


class RolloutFuture:
    def __init__(self, call: Call, cancel: Callable[[Call], None], build: Callable[[Call], RolloutBatch]) -> None:
        self._call, self._cancel, self._build = call, cancel, build
        self._batch: RolloutBatch | None = None

    def done(self) -> bool:
        """Over: every row is back, or the call failed or was cancelled."""
        return self._call.settled.is_set()

    def cancelled(self) -> bool:
        return self._call.cancelled

    def result(self, timeout: float | None = None) -> RolloutBatch:
        if not self._call.settled.wait(timeout):
            raise TimeoutError(f"generate timed out after {timeout}s with {self._call.num_done()}/"
                               f"{len(self._call.samples)} rows done")
        if self._call.cancelled:
            raise CancelledError("this rollout was cancelled")
        if self._call.failure is not None:
            raise RuntimeError(self._call.failure)
        if self._batch is None:
            self._batch = self._build(self._call)
        return self._batch

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
