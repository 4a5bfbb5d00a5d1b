"""Supervisor: the thread that keeps the engine alive and settles calls (mixed into `Engine`).

It wakes when a request failed, when the engine thread died, or when a call is over: a dead engine is rebuilt
(`_restart`: a fresh manager and cache, logged on the "rollout" logger with the error that killed the thread) and
every unfinished sample re-runs, each on its own, up to `max_retries` times (`_heal`); a call that is over is
released from the engine and settled (`_settle`), whether or not anyone waits for it.

Uses the engine's lock (`_cond`), bookkeeping (`_requests`), calls and manager.
"""

from __future__ import annotations

import logging
import traceback

from ..base.errors import logged

LOG = logging.getLogger("rollout")


class Supervisor:
    """Healing and settling, on the engine's "rollout-supervisor" thread."""

    def _supervise(self) -> None:
        """Heal engine deaths and failed requests, and settle calls that are over, whether or not anyone waits."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._requests.rerun) or any(c.is_over() for c in
                                                                                       self._calls), timeout=0.05)
                if self._closed:
                    return
            self._heal()
            self._settle()

    def _settle(self) -> None:
        with self._cond:
            over = [c for c in self._calls if c.is_over()]
            self._calls = [c for c in self._calls if not c.is_over()]
            for call in over:
                self._drop_call(call)  # a failed call's other samples stop too
        for call in over:
            try:
                if call.on_over is not None:
                    call.on_over(call)
            finally:
                call.settle()

    def _heal(self) -> None:
        """If the engine died or requests failed, rebuild it and re-run the lost samples, each on its own."""
        with self._cond:
            if self._manager is None:  # asleep or closed: nothing in flight
                return
            dead = not self.is_alive()
            if not dead and not self._requests.rerun:
                return
            if dead:
                self._restart()
            for sample in self._requests.take_rerun():
                if sample.row is not None:
                    continue
                if sample.attempts > self.config.max_retries:
                    sample.call.failure = (f"prompt {sample.prompt_index} sample {sample.sample_index} failed "
                                           f"{sample.attempts} times; last error: {sample.error}")
                    continue
                self._submit([sample])
            self._cond.notify_all()

    def _restart(self) -> None:
        """Replace a dead manager with a fresh one (fresh cache); what it held is queued for re-running. Logged on
        the "rollout" logger with the error that killed the engine thread."""
        old = self._manager
        error = old.background_thread_status.fatal_error
        LOG.warning("rollout: the engine thread died (%s); rebuilding the engine and re-running its %d requests "
                    "(restart %d)", "no error recorded" if error is None else f"{type(error).__name__}: {error}",
                    len(self._requests.pending), self.num_restarts + 1)
        self._unpause_loop()  # the dead manager's pause, if held (re-taken on the new one)
        with logged("stopping the dead engine's manager"):
            old.stop(block=True, timeout=30)
        if error is not None:  # its frames hold the dead loop's batch processor: its cache is freed now, not whenever
            traceback.clear_frames(error.__traceback__)  # the cycle collector next runs (a log record may keep it)
        self.num_restarts += 1
        self._manager = self._build_manager()
        self._keep_loop_paused()
        self._requests.lost()
