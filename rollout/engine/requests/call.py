"""Sample and Call: what the engine tracks of a submitted generate call until every sample has its row."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...base.batch import Row
from ...base.params import SamplingParams

if TYPE_CHECKING:  # a Sample carries its episode; the episodes room drives samples (it imports this one)
    from ..episodes.episode import Episode

LOG = logging.getLogger("rollout")


@dataclass(eq=False)
class Sample:
    """One requested sample: where it goes in the result, and its outcome. With an environment, the sample is a
    multi-turn episode (`episode`), submitted once per model turn."""

    call: "Call | None"
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: tuple[int, ...]
    attempts: int = 0
    version: int = 0  # the policy version when its current engine request was submitted
    row: Row | None = None  # set when the sample is finished: its row (an episode's: its last segment's)
    segment_rows: list[Row] = field(default_factory=list)  # an episode's earlier segments' rows
    error: str | None = None
    episode: Episode | None = None
    prompt_tokens: int = 0  # tokens its engine requests were prompted with (forked samples: on the head sample, unless
    # split off as a request of their own: see scheduler.py)
    reused_tokens: int = 0  # of those, tokens served by the prefix cache instead of prefilled
    draft_tokens: int = 0  # speculation: draft tokens its engine requests verified (engine thread)
    accepted_tokens: int = 0  # of those, kept

    def counts(self) -> dict[str, int]:
        """The call's counts its rows carry (RolloutBatch.stats)."""
        return dict(prompt_tokens=self.prompt_tokens, reused_tokens=self.reused_tokens,
                    draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens)

    def context(self) -> list[int]:
        """What the next engine request is prompted with: the prompt, or an episode's current segment so far."""
        return self.prompt_ids if self.episode is None else self.episode.context()

    def rows(self) -> list[Row]:
        """The finished sample's rows: one, or one per segment of an episode."""
        return [*self.segment_rows, self.row]

    def budget(self) -> int:
        """New tokens the next engine request may generate."""
        if self.episode is None:
            return self.params.max_new_tokens
        return self.episode.turn_budget(self.params.max_new_tokens)


@dataclass(eq=False)
class Call:
    """The samples of one submitted generate call. It is over when every sample has a row, when a sample failed
    past its retries (`failure`), or when it was cancelled (`cancelled`: timed out, interrupted, or cancelled by its
    future). `on_over` runs once it is over, on the engine's supervisor thread (never on the engine thread, which
    may be needed to pause the loop), and `settled` is set after it; then the callbacks of `add_done_callback` run.

    Groups: the samples of one prompt. `finish` gives a sample its row (where the engine settles it, lock held);
    when that completes the prompt's group, its index joins `completed` (finishing order) and `changed` is notified,
    so a reader waits on `changed` instead of polling. `discarded_tokens` counts the tokens a cancel threw away.

    `on_tokens(sample, token_ids, logprobs, token_versions, top)`, when set, streams the call: it is called on the
    engine thread after every step that samples a token for one of its samples, with everything that sample's request
    has generated so far (`top`: per token its (ids, logprobs) top list when its params ask top_logprobs, else None) (a re-run request, after an engine restart or an "abort" update, starts again from its first
    token). It must return quickly (hand the lists to another thread); the row delivered at the end is the same."""

    samples: list[Sample] = field(default_factory=list)
    failure: str | None = None
    cancelled: bool = False
    index: int | None = None  # the call's order on its engine: keys the random streams of its unseeded samples
    on_over: Callable[["Call"], None] | None = None
    on_tokens: Callable[[Sample, list[int], list[float], list[int], list | None], None] | None = None
    settled: threading.Event = field(default_factory=threading.Event)
    completed: list[int] = field(default_factory=list)  # prompt indices whose every sample has its row, in order
    changed: threading.Condition = field(default_factory=threading.Condition)
    discarded_tokens: int = 0  # model tokens sampled for rows that a cancel dropped
    _done_callbacks: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _callbacks_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        for sample in self.samples:
            sample.call = self
        self._left = Counter(sample.prompt_index for sample in self.samples)  # samples without a row, per prompt

    @property
    def num_groups(self) -> int:
        return len(self._left)

    def finish(self, sample: Sample, row: Row) -> None:
        """`sample` has its final row; a group complete with it is announced."""
        sample.row = row
        self._left[sample.prompt_index] -= 1
        if self._left[sample.prompt_index] == 0:
            with self.changed:
                self.completed.append(sample.prompt_index)
                self.changed.notify_all()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Run `fn()` once the call is settled: at once (here) if it already is, else on the thread that settles it."""
        with self._callbacks_lock:
            if not self.settled.is_set():
                self._done_callbacks.append(fn)
                return
        fn()

    def settle(self) -> None:
        """The call is over and its `on_over` has run: set `settled`, wake every waiter, then run the done callbacks,
        each once. One that raises is logged on the "rollout" logger with its traceback: it runs on the engine's
        supervisor thread, which must live on."""
        with self._callbacks_lock:
            self.settled.set()
            callbacks, self._done_callbacks = self._done_callbacks, []
        with self.changed:
            self.changed.notify_all()
        for fn in callbacks:
            try:
                fn()
            except Exception:  # noqa: BLE001
                LOG.exception("rollout: a done callback of a generate call raised; the call itself is settled")

    def is_over(self) -> bool:
        return self.cancelled or self.failure is not None or all(s.row is not None for s in self.samples)

    def num_done(self) -> int:
        return sum(s.row is not None for s in self.samples)
