"""Environments for multi-turn episodes: the protocol a `generate(..., env=make_env)` call drives.

    def make_env(prompt_index: int, sample_index: int) -> Environment: ...   # once per episode (one per sample)

    class Environment(Protocol):
        def step(self, completion_ids: list[int]) -> Turn: ...   # or `async def step`
        def close(self) -> None: ...                             # optional

After each model turn the engine calls `step` with that turn's tokens (its stop token included) off the engine thread.
Unless the Turn says `done` (or the episode is out of turns or tokens), its observation tokens are appended and the
model's next turn is generated from the whole history. Token ids in, token ids out: the model's own tokens are never
re-tokenized. This module knows nothing about tokenizers (see rollout.tools for a chat-level environment).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .errors import invalid

FINISH_REASONS = ("done", "max_turns", "length", "error")  # how an episode ends (`RolloutBatch.finish_reason`)


@dataclass(frozen=True)
class Turn:
    """What an environment answers to one model turn.

    observation_ids: tokens appended after the model's turn (masked out of the loss); ignored when the episode ends.
    reward: this turn's reward; an episode's reward is the sum over its turns.
    done: the episode ends after this turn (finish_reason "done").
    """

    observation_ids: Sequence[int] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False

    def __post_init__(self) -> None:
        ids = self.observation_ids
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or \
                not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise invalid("observation_ids", _short(ids), "must be a list of int token ids",
                          "tokenize the observation and return its ids")
        object.__setattr__(self, "observation_ids", list(ids))
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise invalid("reward", self.reward, "must be a finite number", "return e.g. 0.0 or 1.0")
        object.__setattr__(self, "reward", float(self.reward))
        if not isinstance(self.done, bool):
            raise invalid("done", self.done, "must be a bool", "return done=True to end the episode")


@runtime_checkable
class Environment(Protocol):
    def step(self, completion_ids: list[int]) -> "Turn | Awaitable[Turn]": ...


EnvFactory = Callable[[int, int], Environment]


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
