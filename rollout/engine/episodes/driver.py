"""EpisodeDriver: multi-turn episodes between the engine's turns.

A finished model turn of an episode is recorded on its `Episode` (episode.py) and its environment steps off the
engine thread (stepper.py); when the observation is back the driver asks the engine to submit the next turn, or ends
the episode and finishes its sample with the episode's rows. It shares the engine's lock (`cond`) and counters, and
is given at construction the one engine action it needs (`submit`), so it never calls up into the engine otherwise.

Threads: `turn_done` runs on the engine thread with the lock held; `_on_step` on a stepper thread (it takes the
lock); `abandon`, `abort`, `reset` and `stop` are called by the engine with the lock held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ...base.batch import Row
from ...base.routing import Routing
from ..requests.call import Sample
from ..observe.counters import Counters
from .episode import Episode
from .stepper import Stepper

Submit = Callable[[list[Sample], float], None]  # (the episode's sample, when its observation came back)


class EpisodeDriver:
    def __init__(self, cond: threading.Condition, counters: Counters, env_threads: int, submit: Submit,
                 current_version: Callable[[], int]) -> None:
        self._cond, self._counters, self._submit, self._version = cond, counters, submit, current_version
        self._stepper = Stepper(env_threads)
        self.stepping: set[Sample] = set()  # episodes whose environment step is running
        self._closed = False

    def turn_done(self, sample: Sample, tokens: list[int], logprobs: list[float], sampling: list[float],
                  versions: list[int], tops, routing: Routing | None) -> None:
        """A model turn of an episode finished (engine thread, lock held): record it and start its environment
        step off this thread."""
        episode = sample.episode
        episode.add_turn(tokens, logprobs, sampling, versions, tops)
        episode.segment.routing = routing  # the last turn's request fed every position of its segment so far
        self.stepping.add(sample)
        epoch = episode.epoch
        self._stepper.step(episode, sample.prompt_index, sample.sample_index, episode.timeout,
                           lambda turn, error, seconds: self._on_step(sample, epoch, turn, error, seconds))

    def _on_step(self, sample: Sample, epoch: int, turn, error: BaseException | None, seconds: float) -> None:
        """An environment step returned after `seconds` (stepper thread): submit the episode's next turn, or end
        it."""
        ready = time.perf_counter()
        with self._cond:
            episode = sample.episode
            if self._closed or episode.epoch != epoch or sample not in self.stepping:  # closed, reset or abandoned
                return  # meanwhile (a plain step's pool thread may return after the engine closed)
            self._counters.env_step(seconds, error is not None)
            self.stepping.discard(sample)
            if sample.call.is_over():  # cancelled or failed meanwhile
                self._stepper.close_env(episode.env)
                return
            if episode.after_step(turn, error):
                self._submit([sample], ready)
            else:
                sample.call.finish(sample, self._end(sample))
            self._cond.notify_all()

    def _end(self, sample: Sample) -> Row:
        """Close the episode's environment, count it, and return its last row (earlier segments' rows are kept on
        the sample)."""
        episode = sample.episode
        self._stepper.close_env(episode.env)
        *sample.segment_rows, last = episode.rows(sample.prompt_index, sample.sample_index, sample.counts())
        self._counters.episode(episode.finish_reason, [v for seg in episode.segments for v in seg.token_versions],
                               self._version(), episode.num_turns, rows=len(episode.segments))
        return last

    def abandon(self, sample: Sample) -> None:
        """The sample's call is over (lock held): its step's outcome is dropped, its environment closed."""
        self.stepping.discard(sample)
        if sample.episode is not None and sample.row is None:  # an ended episode closed its own
            self._stepper.close_env(sample.episode.env)
            sample.episode.env = None

    def abort(self) -> list[Sample]:
        """Every episode in an environment step, dropped for a re-run (lock held); see `reset`."""
        aborted, self.stepping = list(self.stepping), set()
        return aborted

    def reset(self, episode: Episode) -> None:
        """An aborted episode runs again from scratch, with a fresh environment."""
        self._stepper.close_env(episode.env)
        episode.reset()

    def stop(self) -> None:
        """No episode submits another turn from now on (the engine is closing; lock held)."""
        self._closed = True

    def shutdown(self) -> None:
        """Stop the stepper's threads (after `stop`, without the lock: a step in flight may be waiting for it)."""
        self._stepper.shutdown()
