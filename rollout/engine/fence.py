"""The weight fence: how the engine lets its model's weights change under it (mixed into `Engine`).

- `exclusive(mode)`: the caller holds the model alone (no new submission, the loop paused) while it changes weights
  in place; what is in flight "wait"s, is "abort"ed (re-run after), "recompute"s its KV under the new weights, or is
  "keep"t; after the block the prefix cache is forgotten (upstream/switch.py), so no later request reads KV computed
  with other weights;
- `hold(mode)` / `release()`: the loop stays paused until released (a server's /pause and /resume), on every manager
  built meanwhile (`LoopPause`); weight updates may land while held;
- `paused()`: no forward runs inside.

Uses the engine's lock (`_cond`), bookkeeping (`_requests`), driver, manager, recorder and counters.
"""

from __future__ import annotations

import contextlib
import threading
import time

from ..base.config import check_in_flight
from ..base.errors import invalid
from .requests.call import Sample
from .upstream import switch

PAUSE_TRIES = 3  # engines in a row that may die while a pause is asked for before the pause fails


class WeightFence:
    """Weight changes, holds and pauses of `Engine`."""

    @contextlib.contextmanager
    def exclusive(self, mode: str = "wait", invalidate: bool = True):
        """Hold the model alone while the caller changes weights in place: no new submission, the loop paused, and
        what is in flight handled by `mode`:
        - "wait": it finishes first, on the old weights (whole episodes, environment steps included);
        - "abort": it is cancelled, then re-run from scratch (episodes with a fresh environment) after the block;
        - "recompute": it stays; after the block its KV is recomputed by the new weights before it samples again;
        - "keep": it stays and continues on its old-weight KV (tokens after the switch are approximate).
        After the block every prefix-cache hash is forgotten (unless `invalidate` is False, for read-only use)."""
        check_in_flight(mode)
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            if mode == "wait" and self._frozen():
                raise invalid("in_flight", mode, f"the engine is paused with {self._frozen()} requests frozen, "
                              "which would never finish", "pass 'recompute', 'keep' or 'abort', or resume first")
            self._updating = True
        fenced, recomputed = time.perf_counter(), 0
        aborted: list[Sample] = []
        try:
            if mode == "wait":
                self._drain()
            elif mode == "abort":
                aborted = self._abort_in_flight()
            # asleep: no loop to pause and no cached KV to forget (waking builds an empty cache)
            with self._loop_paused():
                paused = time.perf_counter()
                yield
                if self._manager is not None and mode == "recompute":
                    requests, recomputed = switch.recompute_in_flight(self._manager)
                    self.num_recomputed += requests
                if self._manager is not None and invalidate:
                    switch.forget_prefix_cache(self._manager)
                    if self._recorder is not None:
                        with self._cond:
                            self._recorder.forget(set(self._requests.pending))
                            if mode == "recompute":  # every request in flight is prefilled again
                                self._recorder.soft_reset(list(self._recorder.buffers))
            if invalidate:  # a weight change (read-only uses, e.g. scoring, are not counted)
                now = time.perf_counter()
                with self._cond:
                    self.counters.weight_update(mode, now - fenced, now - paused, recomputed)
        finally:
            with self._cond:
                self._updating = False
                self._requests.rerun.extend(aborted)
                for sample in aborted:
                    sample.attempts -= 1  # an abort is not a failure
                self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self):
        """No forward runs inside (a no-op while asleep)."""
        with self._loop_paused():
            yield

    @contextlib.contextmanager
    def _loop_paused(self):
        """The engine's loop paused for the block (nothing to pause while asleep). A dead engine is rebuilt first;
        an engine thread that dies while the pause is asked for (a step raised: upstream then refuses the pause) is
        rebuilt and asked again, so a weight update never fails because an engine step did (what the dead thread
        held re-runs, as after any engine death). Raises only if PAUSE_TRIES engines in a row die that way."""
        with contextlib.ExitStack() as stack:
            for attempt in range(1, PAUSE_TRIES + 1):
                with self._cond:
                    manager = None if self._closed else self._manager
                    if manager is not None and not self.is_alive():
                        self._restart()
                        manager = self._manager
                if manager is None:
                    break
                try:
                    stack.enter_context(manager.pause())
                    break
                except RuntimeError:  # not paused: the loop died meanwhile, or that engine was replaced or put asleep
                    with self._cond:
                        if attempt == PAUSE_TRIES or (self._manager is manager and self.is_alive()):
                            raise
            yield

    @property
    def is_held(self) -> bool:
        return self._on_hold

    def hold(self, mode: str = "keep") -> None:
        """Stop generating until `release()`. What is in flight is handled by `mode` first: "wait" finishes it,
        "abort" cancels it (re-run from scratch after the release), "keep" freezes it where it is (continued after the
        release). Submissions made meanwhile are accepted and queue. Weight updates may land while held, with their
        own in_flight mode ("wait" is refused while frozen work exists: it would never finish). A no-op if held."""
        check_in_flight(mode)
        if mode == "recompute":
            raise invalid("in_flight", mode, "a pause takes 'wait', 'abort' or 'keep'",
                          "pass in_flight='recompute' to the weight update made while paused")
        if self._on_hold:
            return
        with self.exclusive(mode, invalidate=False):
            with self._cond:
                self._on_hold = True
                self._keep_loop_paused()

    def release(self) -> None:
        """Resume generating after `hold()` (a no-op when not held)."""
        with self._cond:
            self._on_hold = False
            self._unpause_loop()
            self._cond.notify_all()

    def _keep_loop_paused(self) -> None:
        """While held, keep the current manager's loop paused (lock held)."""
        if self._on_hold and self._loop_pause is None and self._manager is not None:
            self._loop_pause = LoopPause(self._manager)

    def _unpause_loop(self) -> None:
        pause, self._loop_pause = self._loop_pause, None
        if pause is not None:
            pause.release()

    def _frozen(self) -> int:
        """Requests a hold keeps from finishing: waiting for them would never end (lock held)."""
        if not self._on_hold:
            return 0
        return len(self._requests.pending) + len(self._requests.rerun) + len(self._driver.stepping)

    def _drain(self) -> None:
        with self._cond:
            while not self._cond.wait_for(lambda: self._requests.idle() and not self._driver.stepping,
                                          timeout=0.05):
                pass

    def _abort_in_flight(self) -> list[Sample]:
        with self._cond:
            request_ids, aborted = self._requests.take_all()
            aborted += self._driver.abort()
            for request_id in request_ids:
                self._manager.cancel_request(request_id)
            aborted = [s for s in aborted if s.row is None]
            for sample in aborted:
                sample.error = "aborted by a weight update"
                if sample.episode is not None:  # re-run from scratch, with a fresh environment
                    self._driver.reset(sample.episode)
            self.num_aborted += len(aborted)
            return aborted


    def forget_prefix_cache(self) -> None:
        """No request submitted from now on can match KV computed before (see switch.py); inside `paused()`."""
        if self._manager is None:  # asleep: waking builds an empty cache
            return
        switch.forget_prefix_cache(self._manager)
        if self._recorder is not None:
            self._recorder.forget()


class LoopPause:
    """A manager's loop kept paused from a thread of its own, until `release()`: upstream counts pauses per thread
    (a thread inside one may not stop the manager), so the thread that takes a pause must be the one that leaves it,
    whichever threads call hold and release."""

    def __init__(self, manager) -> None:
        self._entered, self._done = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(manager,), daemon=True, name="rollout-hold")
        self._thread.start()
        self._entered.wait()
        if self._error is not None:
            raise self._error

    def _run(self, manager) -> None:
        try:
            with manager.pause():
                self._entered.set()
                self._done.wait()
        except BaseException as error:  # noqa: BLE001  (raised by the constructor)
            self._error = error
            self._entered.set()

    def release(self) -> None:
        self._done.set()
        self._thread.join()
