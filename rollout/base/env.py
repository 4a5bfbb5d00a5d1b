"""Environments for multi-turn episodes: the protocol a `generate(..., env=make_env)` call drives.

    def make_env(prompt_index: int, sample_index: int) -> Environment: ...   # once per episode (one per sample)

    class Environment(Protocol):
        def step(self, completion_ids: list[int]) -> Turn: ...   # or `async def step`
        def close(self) -> None: ...                             # optional

After each model turn the engine calls `step` with that turn's tokens (its stop token included) off the engine thread.
Unless the Turn says `done` (or the episode is out of turns or tokens), its observation tokens are appended and the
model's next turn is generated from the whole history; or, when the Turn carries `context_ids` (the whole chat
rendered again, e.g. by a template that drops earlier reasoning), from exactly those tokens: the episode then has
several segments, one batch row each. Token ids in, token ids out: the model's own tokens are never re-tokenized.
This module knows nothing about tokenizers (see rollout.envs.tools for a chat-level environment).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .errors import check_int, invalid, preview


def _token_ids(name: str, ids: Any, fix: str) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid(name, preview(ids), "must be a list of int token ids", fix)
    return list(ids)


@dataclass(frozen=True)
class Turn:
    """What an environment answers to one model turn.

    observation_ids: tokens appended after the model's turn (masked out of the loss); ignored when the episode ends.
    reward: this turn's reward (on the turn's last model token in `batch.turn_rewards`); an episode's reward is the
        sum over its turns.
    done: the episode ends after this turn (finish_reason "done").
    context_ids: None, or the exact tokens the next model turn is generated from (the whole chat rendered again,
        generation prompt included), instead of the history plus `observation_ids`. If they extend the history, the
        rest is the observation (one segment goes on); otherwise the next turn starts a new segment (a new row).
        Give either `observation_ids` or `context_ids`, not both.
    """

    observation_ids: Sequence[int] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    context_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "observation_ids", _token_ids("observation_ids", self.observation_ids,
                                                               "tokenize the observation and return its ids"))
        if self.context_ids is not None:
            context = _token_ids("context_ids", self.context_ids, "return the re-rendered chat's token ids")
            if not context:
                raise invalid("context_ids", context, "must hold at least one token when given",
                              "return None to go on from the history, or the whole re-rendered chat")
            if self.observation_ids:
                raise invalid("observation_ids", preview(self.observation_ids), "must be empty when context_ids is "
                              "given (the context already holds the observation)",
                              "return either observation_ids or context_ids")
            object.__setattr__(self, "context_ids", context)
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise invalid("reward", self.reward, "must be a finite number", "return e.g. 0.0 or 1.0")
        object.__setattr__(self, "reward", float(self.reward))
        if not isinstance(self.done, bool):
            raise invalid("done", self.done, "must be a bool", "return done=True to end the episode")


@runtime_checkable
class Environment(Protocol):
    def step(self, completion_ids: list[int]) -> "Turn | Awaitable[Turn]": ...


EnvFactory = Callable[[int, int], Environment]


@dataclass(frozen=True)
class EpisodeSpec:
    """How the episodes of one `generate(..., env=...)` call run. Validated before anything is submitted.

    env: `make_env(prompt_index, sample_index) -> Environment`, called once per episode (picklable for a fleet).
    max_turns: model turns per episode, at least 1.
    max_episode_tokens: budget of an episode's completion (turns and observations); None: what the model's context
        and the KV cache allow for one request.
    env_timeout: seconds one environment step may take (None: no limit); past it the episode ends with "error".
    """

    env: EnvFactory
    max_turns: int = 1
    max_episode_tokens: int | None = None
    env_timeout: float | None = 300.0

    def __post_init__(self) -> None:
        if not callable(self.env):
            raise invalid("env", preview(self.env), "must be callable as make_env(prompt_index, sample_index)",
                          "pass a function or class that returns an Environment")
        check_int("max_turns", self.max_turns, 1, "allow at least 1 model turn per episode")
        if self.max_episode_tokens is not None:
            check_int("max_episode_tokens", self.max_episode_tokens, 1,
                      "use None for what the context allows, or a positive budget")
        if self.env_timeout is not None and (isinstance(self.env_timeout, bool)
                                             or not isinstance(self.env_timeout, (int, float))
                                             or not self.env_timeout > 0):
            raise invalid("env_timeout", self.env_timeout, "must be None or a number of seconds > 0",
                          "use e.g. 60.0, or None for no limit")

    @classmethod
    def of(cls, env: EnvFactory | None, max_turns: int, max_episode_tokens: int | None,
           env_timeout: float | None, episode: "EpisodeSpec | None" = None) -> "EpisodeSpec | None":
        """The spec of a call, or None for a plain (single-turn, environment-free) call: `episode` as given, or the
        one the keywords (sugar for it) describe; both at once is refused."""
        if episode is not None:
            if not isinstance(episode, EpisodeSpec):
                raise invalid("episode", preview(episode), "must be a rollout.EpisodeSpec",
                              "pass episode=EpisodeSpec(make_env, max_turns=...), or the env= keywords")
            if env is not None or max_turns != 1 or max_episode_tokens is not None or env_timeout != 300.0:
                raise invalid("episode", episode, "the episode fields were given twice (episode= and env=, "
                              "max_turns=, max_episode_tokens= or env_timeout=)",
                              "pass episode=EpisodeSpec(...) alone, or the keywords alone")
            return episode
        if env is not None:
            return cls(env, max_turns, max_episode_tokens, env_timeout)
        if max_turns != 1 or max_episode_tokens is not None:
            field_name, value = ("max_turns", max_turns) if max_turns != 1 else ("max_episode_tokens",
                                                                                  max_episode_tokens)
            raise invalid(field_name, value, "only applies to multi-turn episodes", "pass env=make_env, or leave "
                          "max_turns=1 and max_episode_tokens=None")
        return None

    def kwargs(self) -> dict[str, Any]:
        """The `generate` keywords that give this spec back."""
        return dict(env=self.env, max_turns=self.max_turns, max_episode_tokens=self.max_episode_tokens,
                    env_timeout=self.env_timeout)

    def budget(self, prompt_len: int, limit: int, index: int) -> int:
        """The completion budget of an episode whose prompt (prompt `index` of its call) has `prompt_len` tokens,
        when one request may hold `limit` tokens (the model context and the KV cache)."""
        room = limit - prompt_len
        if self.max_episode_tokens is None:
            return room
        if self.max_episode_tokens > room:
            raise invalid("max_episode_tokens", self.max_episode_tokens,
                          f"prompt length {prompt_len} + max_episode_tokens exceeds what one request may hold "
                          f"({limit} tokens: the model context and the KV cache)",
                          f"use max_episode_tokens <= {room}, None, or a larger KV cache", f"prompt {index}", index)
        return self.max_episode_tokens
