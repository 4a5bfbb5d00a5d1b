"""Stepper: runs environment steps off the engine thread, so no episode ever waits for another.

One event loop on its own daemon thread drives every step: an `async def step` runs on the loop; a plain `step` (and
`make_env`, on an episode's first step) runs on a thread pool. Each step is bounded by `timeout` seconds; the
outcome goes to a callback with either the step's result or the exception it raised, and the seconds it took
(`make_env` included on an episode's first step). A plain step's outcome is handed over on the pool thread that ran
it, the moment it returns: the next turn is submitted from there, without waiting for the event loop to be scheduled
(a hop that costs a thread switch, and under load a GIL switch interval or more, per turn). An async step's outcome
is handed over on the loop. Only the first outcome counts: a timed-out `async` step is cancelled; a timed-out sync
step cannot be interrupted in Python, so its pool thread stays busy until the function returns and its result is
then dropped: the pool is sized for that (`WorkerConfig.env_threads`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .episode import Episode

StepCallback = Callable[[Any, "BaseException | None", float], None]


class Stepper:
    def __init__(self, num_threads: int) -> None:
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="rollout-env")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="rollout-env-loop")
        self._thread.start()

    def step(self, episode: Episode, prompt_index: int, sample_index: int, timeout: float | None,
             callback: StepCallback) -> None:
        """Start one step of `episode` on its last model turn; `callback(turn, error, seconds)` gets the outcome."""
        asyncio.run_coroutine_threadsafe(self._run(episode, prompt_index, sample_index, timeout, callback), self._loop)

    def close_env(self, env: Any) -> None:
        """Call `env.close()` (if defined) on the pool; errors there end nothing."""
        close = getattr(env, "close", None)
        if callable(close):
            self._pool.submit(_quietly, close)

    def shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, episode: Episode, prompt_index: int, sample_index: int, timeout: float | None,
                   callback: StepCallback) -> None:
        start, deliver = time.perf_counter(), _First(callback)
        try:
            turn = await asyncio.wait_for(self._call(episode, prompt_index, sample_index, deliver, start), timeout)
        except asyncio.TimeoutError:
            deliver(None, TimeoutError(f"no answer within env_timeout={timeout}s"), time.perf_counter() - start)
        except BaseException as error:  # the episode's failure, not the engine's
            deliver(None, error, time.perf_counter() - start)
        else:
            deliver(turn, None, time.perf_counter() - start)  # a no-op when the pool thread handed it over already

    async def _call(self, episode: Episode, prompt_index: int, sample_index: int, deliver: "_First",
                    start: float) -> Any:
        loop = asyncio.get_running_loop()
        if episode.env is None:
            epoch = episode.epoch
            env = await loop.run_in_executor(self._pool, episode.factory, prompt_index, sample_index)
            if episode.epoch != epoch:  # the episode was reset meanwhile: this environment belongs to nobody
                self.close_env(env)
                raise asyncio.CancelledError
            episode.env = env
        step = episode.env.step
        ids = list(episode.last_turn)
        if inspect.iscoroutinefunction(step):
            return await step(ids)
        result = await loop.run_in_executor(self._pool, _run_sync, step, ids, deliver, start)
        return await result if inspect.isawaitable(result) else result


class _First:
    """Passes a step's first outcome to its callback and drops the rest (a sync step returning after its timeout,
    or the loop's copy of an outcome the pool thread already handed over)."""

    def __init__(self, callback: StepCallback) -> None:
        self._callback, self._mutex, self._done = callback, threading.Lock(), False

    def __call__(self, turn: Any, error: BaseException | None, seconds: float) -> None:
        with self._mutex:
            if self._done:
                return
            self._done = True
        self._callback(turn, error, seconds)


def _run_sync(step: Callable[[list[int]], Any], ids: list[int], deliver: _First, start: float) -> Any:
    """A plain step on a pool thread; its outcome is handed over here, unless it returned an awaitable (the loop
    awaits that). Its exception is re-raised for the loop too (whose copy `deliver` then drops)."""
    try:
        result = step(ids)
    except BaseException as error:  # noqa: BLE001 - the episode's failure, handed over, then re-raised to the loop
        deliver(None, error, time.perf_counter() - start)
        raise
    if not inspect.isawaitable(result):
        deliver(result, None, time.perf_counter() - start)
    return result


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a failing close must not reach the engine
        pass
