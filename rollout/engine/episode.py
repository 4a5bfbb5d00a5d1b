"""Episode: the state of one multi-turn episode (one sample of a `generate(..., env=...)` call).

The episode's completion is everything after the prompt: model turns and observations interleaved. Each model turn
is one engine request whose prompt is the prompt plus the completion so far, so its full pages hit the prefix cache
and only the observation (plus at most the partial last page) is prefilled. Model tokens carry their two logprobs
and an action-mask True; observation tokens carry 0.0 and False.

This module decides what happens after each environment step (`after_step`); the engine submits the next turn or
ends the episode, and `stepper.py` runs the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..env import EnvFactory, Turn


@dataclass
class Episode:
    factory: EnvFactory
    max_turns: int
    max_tokens: int  # completion budget of the whole episode (turns + observations)
    vocab_size: int
    timeout: float | None = None  # seconds each environment step may take (the first includes make_env)
    env: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # -1 on observation tokens
    reward: float = 0.0
    num_turns: int = 0
    finish_reason: str | None = None
    error: str = ""
    epoch: int = 0  # bumped by `reset`: a step that returns for an older epoch is dropped
    last_turn: list[int] = field(default_factory=list)
    routing: Any = None  # the last model turn's recorded routing (rollout.moe.Routing), when recording

    def turn_budget(self, max_new_tokens: int) -> int:
        """New tokens the next model turn may generate: its own budget, within what is left of the episode's."""
        return min(max_new_tokens, self.max_tokens - len(self.tokens))

    def add_turn(self, tokens: list[int], logprobs: list[float], sampling: list[float], versions: list[int]) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.sampling_logprobs += sampling
        self.action_mask += [True] * len(tokens)
        self.token_versions += versions
        self.num_turns += 1
        self.last_turn = list(tokens)

    def after_step(self, turn: Any, error: BaseException | None) -> bool:
        """Apply one environment step's outcome. Returns True when the episode goes on (its observation appended),
        False when it ended (finish_reason set)."""
        if error is None and not isinstance(turn, Turn):
            error = TypeError(f"step returned {type(turn).__name__}, not a Turn")
        if error is not None:
            return self._fail(f"turn {self.num_turns}: environment error: {type(error).__name__}: {error}"
                              if str(error) else f"turn {self.num_turns}: environment error: {error!r}")
        bad = [t for t in turn.observation_ids if not 0 <= t < self.vocab_size]
        if bad:
            return self._fail(f"turn {self.num_turns}: observation token id {bad[0]} is outside the vocabulary "
                              f"[0, {self.vocab_size})")
        self.reward += turn.reward
        if turn.done:
            return self._end("done")
        if self.num_turns >= self.max_turns:
            return self._end("max_turns")
        if len(self.tokens) + len(turn.observation_ids) + 1 > self.max_tokens:  # no room for one more model token
            return self._end("length")
        self._observe(turn.observation_ids)
        return True

    def reset(self) -> None:
        """Back to the start (an aborted episode re-runs from scratch with a fresh environment)."""
        self.__init__(self.factory, self.max_turns, self.max_tokens, self.vocab_size, self.timeout,
                      epoch=self.epoch + 1)

    def _observe(self, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.sampling_logprobs += [0.0] * len(ids)
        self.action_mask += [False] * len(ids)
        self.token_versions += [-1] * len(ids)

    def _end(self, reason: str) -> bool:
        self.finish_reason = reason
        return False

    def _fail(self, message: str) -> bool:
        self.error = message
        return self._end("error")
