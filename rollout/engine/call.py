"""Sample and Call: what the engine tracks of a submitted generate call until every sample has its row."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..batch import Row
from ..params import SamplingParams
from .episode import Episode


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
    row: Row | None = None
    error: str | None = None
    episode: Episode | None = None
    prompt_tokens: int = 0  # tokens its engine requests were prompted with (forked samples: on the head sample, unless
    # split off as a request of their own: see scheduler.py)
    reused_tokens: int = 0  # of those, tokens served by the prefix cache instead of prefilled

    def context(self) -> list[int]:
        """What the next engine request is prompted with: the prompt, plus an episode's history so far."""
        return self.prompt_ids if self.episode is None else self.prompt_ids + self.episode.tokens

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
    may be needed to pause the loop), and `settled` is set after it."""

    samples: list[Sample] = field(default_factory=list)
    failure: str | None = None
    cancelled: bool = False
    index: int | None = None  # the call's order on its engine: keys the random streams of its unseeded samples
    on_over: Callable[["Call"], None] | None = None
    settled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        for sample in self.samples:
            sample.call = self

    def is_over(self) -> bool:
        return self.cancelled or self.failure is not None or all(s.row is not None for s in self.samples)

    def num_done(self) -> int:
        return sum(s.row is not None for s in self.samples)
