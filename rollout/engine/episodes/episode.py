"""Episode: the state of one multi-turn episode (one sample of a `generate(..., env=...)` call).

An episode is a list of segments. A segment is a run of turns where each turn's prompt extends the previous one:
its own prompt, then model turns and observations interleaved. Each model turn is one engine request prompted with
the segment's prompt plus its tokens so far, so its full pages hit the prefix cache and only the observation (plus
at most the partial last page) is prefilled. When an environment answers `Turn(context_ids=...)` that does not
extend that history (a chat template that rewrote earlier turns), the next turn starts a new segment whose prompt is
exactly `context_ids`; the pages it shares with cached KV still hit the prefix cache. Model tokens carry their two
logprobs, an action-mask True and, on a turn's last token, that turn's reward; observation tokens carry 0.0, False
and version -1. Each segment becomes one row of the batch (`rows`).

This module decides what happens after each environment step (`after_step`); the engine submits the next turn or
ends the episode, and `stepper.py` runs the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...base.batch import Row
from ...base.env import EnvFactory, Turn
from ..requests.ledger import Top, split_tops

NO_TOP: Top = ([], [])  # an observation token's top list (or a model token's that asked for none)


@dataclass
class Segment:
    """The turns of an episode generated from one prompt: `prompt`, then `tokens` (turns and observations)."""

    prompt: list[int]
    budget: int  # tokens after the prompt this segment may hold (turns + observations)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # -1 on observation tokens
    turn_rewards: list[float] = field(default_factory=list)  # a turn's reward on its last model token, 0.0 elsewhere
    routing: Any = None  # its last model turn's recorded routing (rollout.moe.Routing), when recording
    tops: list[Top] | None = None  # per token, once a model turn asked for top_logprobs

    def add(self, tokens: list[int], logprobs: list[float], sampling: list[float], versions: list[int],
            model: bool, tops: list[Top] | None = None) -> None:
        if tops is not None and self.tops is None:
            self.tops = [NO_TOP] * len(self.tokens)
        if self.tops is not None:
            self.tops += tops if tops is not None else [NO_TOP] * len(tokens)
        self.tokens += tokens
        self.logprobs += logprobs
        self.sampling_logprobs += sampling
        self.action_mask += [model] * len(tokens)
        self.token_versions += versions
        self.turn_rewards += [0.0] * len(tokens)


@dataclass
class Episode:
    factory: EnvFactory
    max_turns: int
    max_tokens: int  # the first segment's budget after the prompt (turns + observations)
    vocab_size: int
    timeout: float | None = None  # seconds each environment step may take (the first includes make_env)
    prompt: list[int] = field(default_factory=list)  # the episode's prompt (the first segment's)
    limit: int | None = None  # tokens one engine request may hold (a segment's prompt + its tokens); None: no limit
    cap: int | None = None  # max_episode_tokens: bounds every segment's tokens after its prompt; None: the limit
    env: Any = None
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    num_turns: int = 0
    finish_reason: str | None = None
    error: str = ""
    epoch: int = 0  # bumped by `reset`: a step that returns for an older epoch is dropped
    last_turn: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.segments:
            self.segments = [Segment(list(self.prompt), self.max_tokens)]

    @property
    def segment(self) -> Segment:
        """The segment the next model turn extends."""
        return self.segments[-1]

    @property
    def tokens(self) -> list[int]:
        """The current segment's tokens after its prompt."""
        return self.segment.tokens

    def context(self) -> list[int]:
        """What the next model turn is prompted with: the current segment's prompt and tokens."""
        return self.segment.prompt + self.segment.tokens

    def turn_budget(self, max_new_tokens: int) -> int:
        """New tokens the next model turn may generate: its own budget, within what is left of the segment's."""
        return min(max_new_tokens, self.segment.budget - len(self.segment.tokens))

    def add_turn(self, tokens: list[int], logprobs: list[float], sampling: list[float], versions: list[int],
                 tops: list[Top] | None = None) -> None:
        self.segment.add(tokens, logprobs, sampling, versions, model=True, tops=tops)
        self.num_turns += 1
        self.last_turn = list(tokens)

    def after_step(self, turn: Any, error: BaseException | None) -> bool:
        """Apply one environment step's outcome. Returns True when the episode goes on (its observation appended,
        or a new segment started from the turn's context), False when it ended (finish_reason set)."""
        if error is None and not isinstance(turn, Turn):
            error = TypeError(f"step returned {type(turn).__name__}, not a Turn")
        if error is not None:
            return self._fail(f"turn {self.num_turns}: environment error: {type(error).__name__}: {error}"
                              if str(error) else f"turn {self.num_turns}: environment error: {error!r}")
        problem = self._check(turn)
        if problem:
            return self._fail(f"turn {self.num_turns}: {problem}")
        self.reward += turn.reward
        self.segment.turn_rewards[-1] += turn.reward  # the observation is not appended yet: the turn's last token
        if turn.done:
            return self._end("done")
        if self.num_turns >= self.max_turns:
            return self._end("max_turns")
        observation = turn.observation_ids
        if turn.context_ids is not None:
            history = self.context()
            if turn.context_ids[:len(history)] != history:  # not an extension: the next turn starts a new segment
                self._restart_from(turn.context_ids)
                return True
            observation = turn.context_ids[len(history):]
        if len(self.segment.tokens) + len(observation) + 1 > self.segment.budget:  # no room for one more token
            return self._end("length")
        self.segment.add(observation, [0.0] * len(observation), [0.0] * len(observation), [-1] * len(observation),
                         model=False)
        return True

    def rows(self, prompt_index: int, sample_index: int, counts: dict[str, int]) -> list[Row]:
        """One row per segment; the episode's reward, finish reason, turns and error on each; the call's token
        counts on the first."""
        rows = []
        for index, seg in enumerate(self.segments):
            version = min((v for v in seg.token_versions if v >= 0), default=0)
            top_ids, top_logprobs = split_tops(seg.tops, len(seg.tokens))
            rows.append(Row(prompt_index, sample_index, list(seg.prompt), list(seg.tokens), list(seg.logprobs),
                            list(seg.sampling_logprobs), self.finish_reason, version,
                            action_mask=list(seg.action_mask), reward=self.reward, num_turns=self.num_turns,
                            error=self.error, token_versions=list(seg.token_versions), segment_index=index,
                            turn_rewards=list(seg.turn_rewards), routing=seg.routing, top_ids=top_ids,
                            top_logprobs=top_logprobs, **(counts if index == 0 else {})))
        return rows

    def reset(self) -> None:
        """Back to the start (an aborted episode re-runs from scratch with a fresh environment)."""
        self.__init__(self.factory, self.max_turns, self.max_tokens, self.vocab_size, self.timeout, self.prompt,
                      self.limit, self.cap, epoch=self.epoch + 1)

    def _check(self, turn: Turn) -> str:
        """What is wrong with a turn's token ids ("" if nothing)."""
        bad = [t for t in turn.observation_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"observation token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
        context = turn.context_ids
        if context is None:
            return ""
        bad = [t for t in context if not 0 <= t < self.vocab_size]
        if bad:
            return f"context_ids token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
        if self.limit is not None and len(context) + 1 > self.limit:
            return (f"context_ids has {len(context)} tokens: with one token to generate it exceeds what one request "
                    f"may hold ({self.limit} tokens: the model context and the KV cache)")
        return ""

    def _restart_from(self, context: list[int]) -> None:
        room = self.limit - len(context) if self.limit is not None else None
        bounds = [b for b in (room, self.cap) if b is not None]
        self.segments.append(Segment(list(context), min(bounds, default=self.max_tokens)))

    def _end(self, reason: str) -> bool:
        self.finish_reason = reason
        return False

    def _fail(self, message: str) -> bool:
        self.error = message
        return self._end("error")
