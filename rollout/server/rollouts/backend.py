"""Backend: the rollout side as the server's event loop sees it. `start(prompts, sampling, stream)` submits one
request's work and returns a `Generation` to await (`result()`), to read token by token (`progress`), or to cancel.

- `StreamingBackend`, for a `RolloutWorker` (anything whose `submit` takes `on_tokens`): every request is its own
  call, submitted at once into the continuous batch; streamed requests get every step's tokens; a cancelled request
  (the client went away) is cancelled in the engine: nothing of it keeps running.
- `BatchingBackend`, for any other `Rollouts` (a `RolloutFleet` runs its calls one after another): the requests
  that arrive while a call runs are gathered into the next call (one prompt list, one SamplingParams per prompt),
  and each gets its own rows back. A streamed request gets all its tokens when its call ends; a cancelled one is
  dropped before its call starts, or its rows are discarded when it ends. A call that fails is retried request by
  request, so a failure stays with the request it belongs to.

The engine's threads never wait on the loop: they hand results to it with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...base.batch import RolloutBatch
from ...base.params import SamplingParams
from ...base.rollouts import Rollouts
from ...model.loading import pad_token_id

LOG = logging.getLogger("rollout")

# prompt index, sample index, ids, logprobs, versions, top lists (None unless asked): a streamed row so far
Progress = tuple[int, int, list[int], list[float], list[int], list | None]


class Generation:
    """One request's work. `progress` (streamed requests): an asyncio.Queue of `Progress`, then None at the end.

    The engine reports a streamed row after every step with everything it has so far, so the reports of one row
    that arrive before the loop gets to them are merged into the latest (one chunk with several tokens, not several
    chunks): the engine thread hands over at most one wake-up of the loop per request until the loop has run it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, streaming: bool) -> None:
        self.loop = loop
        self.progress: asyncio.Queue | None = asyncio.Queue() if streaming else None
        self._done: asyncio.Future = loop.create_future()
        self._cancel: Callable[[], None] | None = None
        self.cancelled = False
        self._latest: dict[tuple[int, int], Progress] = {}  # per row, the newest report the loop has not taken
        self._latest_lock = threading.Lock()

    async def result(self) -> RolloutBatch:
        return await asyncio.shield(self._done)

    def done(self) -> bool:
        return self._done.done()

    def cancel(self) -> None:
        """Stop the work (idempotent; returns at once)."""
        if self.cancelled or self._done.done():
            return
        self.cancelled = True
        if self._cancel is not None:
            self._cancel()

    # --- called from other threads
    def push(self, prompt_index: int, sample_index: int, ids: list[int], logprobs: list[float],
             versions: list[int], top: list | None = None) -> None:
        if self.progress is None:
            return
        with self._latest_lock:
            wake = not self._latest
            self._latest[prompt_index, sample_index] = (prompt_index, sample_index, ids, logprobs, versions, top)
        if wake:
            self._on_loop(self._deliver)

    def finish(self, outcome: Callable[[], RolloutBatch]) -> None:
        """The work is over: `outcome()` (run on the loop) gives the batch or raises."""
        self._on_loop(self._settle, outcome)

    def _on_loop(self, fn: Callable, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError as error:  # the loop is closed: the server is gone, nobody waits
            LOG.debug("a generation's report after the server's event loop closed is dropped (%s)", error)

    def _deliver(self) -> None:
        with self._latest_lock:
            latest, self._latest = self._latest, {}
        for item in latest.values():
            self.progress.put_nowait(item)

    def _settle(self, outcome: Callable[[], RolloutBatch]) -> None:
        if not self._done.done():
            try:
                self._done.set_result(outcome())
            except Exception as error:
                self._done.set_exception(error)
                self._done.exception()  # marked retrieved: a request whose client left logs nothing
        if self.progress is not None:
            self._deliver()  # reports not delivered yet come before the end
            self.progress.put_nowait(None)


def backend_for(rollouts: Rollouts) -> "StreamingBackend | BatchingBackend":
    if rollouts.supports_streaming:
        return StreamingBackend(rollouts)
    return BatchingBackend(rollouts)


class StreamingBackend:
    streams = True

    def __init__(self, rollouts: Any) -> None:
        self.rollouts = rollouts
        # submit may wait while a weight update holds the engine, and cancel waits for the call to settle: never on
        # the event loop
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="rollout-serve")

    async def start(self, prompts: list[list[int]], sampling: list[SamplingParams], stream: bool) -> Generation:
        loop = asyncio.get_running_loop()
        generation = Generation(loop, stream)
        on_tokens = generation.push if stream else None
        submitted = loop.run_in_executor(self._pool, lambda: self.rollouts.submit(prompts, sampling,
                                                                                  on_tokens=on_tokens))
        try:
            future = await asyncio.shield(submitted)
        except asyncio.CancelledError:  # the client left while the call was being submitted: cancel it once it is
            submitted.add_done_callback(lambda f: f.cancelled() or f.exception() or self._cancel(f.result()))
            raise
        generation._cancel = lambda: self._cancel(future)
        future.add_done_callback(lambda f: generation.finish(lambda: f.result(0)))
        return generation

    def _cancel(self, future) -> None:
        self._pool.submit(future.cancel)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=False)


@dataclasses.dataclass(eq=False)
class _Job:
    prompts: list[list[int]]
    sampling: list[SamplingParams]
    generation: Generation


class BatchingBackend:
    streams = False

    def __init__(self, rollouts: Any) -> None:
        self.rollouts = rollouts
        self._pending: list[_Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="rollout-serve-batches")
        self._thread.start()

    async def start(self, prompts: list[list[int]], sampling: list[SamplingParams], stream: bool) -> Generation:
        generation = Generation(asyncio.get_running_loop(), stream)
        job = _Job(prompts, sampling, generation)
        generation._cancel = lambda: self._drop(job)
        with self._cond:
            self._pending.append(job)
            self._cond.notify_all()
        return generation

    def _drop(self, job: _Job) -> None:
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._pending))
                if self._closed:
                    return
                jobs, self._pending = self._pending, []
            try:
                self._generate(jobs)
            except BaseException as error:  # fail these requests, never the thread
                for job in jobs:
                    job.generation.finish(_raiser(error))

    def _generate(self, jobs: list[_Job]) -> None:
        prompts = [p for job in jobs for p in job.prompts]
        sampling = [s for job in jobs for s in job.sampling]
        try:
            batch = self.rollouts.generate(prompts, sampling=sampling)
        except Exception as error:
            if len(jobs) == 1:
                jobs[0].generation.finish(_raiser(error))
                return
            for job in jobs:  # one bad request must not fail the others: each alone
                self._generate([job])
            return
        rows = batch.rows()
        offset = 0
        tokenizer = self.rollouts.tokenizer
        pad = pad_token_id(tokenizer)
        for job in jobs:
            mine = [dataclasses.replace(r, prompt_index=r.prompt_index - offset) for r in rows
                    if offset <= r.prompt_index < offset + len(job.prompts)]
            offset += len(job.prompts)
            result = RolloutBatch.from_rows(mine, pad_token_id=pad, tokenizer=tokenizer)
            job.generation.finish(lambda result=result: result)


def _raiser(error: BaseException) -> Callable[[], RolloutBatch]:
    def outcome() -> RolloutBatch:
        raise error

    return outcome
