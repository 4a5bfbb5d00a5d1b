"""EpisodeRecorder: every call made under an `episode_id`, exactly as sampled, and the RolloutBatch a trainer takes.

Each call is kept as the engine saw it: its prompt ids and, per choice, the sampled ids, both logprobs and the
version of each token (after any stop-string cut, as the client got them). Nothing is re-tokenized.

Rows are built when taken. An episode is a sequence of segments; a segment is one row: a prompt, then the model's
tokens (action mask True) with the tokens that came between its calls (tool results, user turns: mask False,
logprobs 0, version -1). A call continues the segment whose tokens so far (prompt + completions + in-between) are a
prefix of its prompt (the longest such); otherwise it starts a new segment whose prompt is its whole prompt (a
template that rewrote the history, a harness that edited it). With n > 1, choice 0 continues the segment and every
other choice starts its own, so a later call can continue any of them. Field names follow the episodes API
(`episode_index`, `segment_index`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...base.batch import RolloutBatch, Row
from .choices import Choice


@dataclass(frozen=True)
class EpisodeBatch(RolloutBatch):
    """A RolloutBatch of recorded episodes, one row per segment, episode by episode: `episode_index` is the position
    of the row's episode in the ids taken (also `prompt_index`; `sample_index` is 0), `segment_index` the row's
    segment within its episode, in order, as in a `generate(..., env=...)` batch.
    episode_ids: R strings, the row's episode id."""

    episode_ids: list[str] = field(default_factory=list)


@dataclass
class _Call:
    prompt_ids: list[int]
    choices: list[Choice]


@dataclass
class _Segment:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    num_turns: int = 0

    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def add(self, prompt_ids: list[int], choice: Choice) -> None:
        between = prompt_ids[len(self.context()):]
        self.tokens += between + choice.token_ids
        self.logprobs += [0.0] * len(between) + choice.logprobs
        self.sampling_logprobs += [0.0] * len(between) + choice.sampling_logprobs
        self.action_mask += [False] * len(between) + [True] * len(choice.token_ids)
        self.token_versions += [-1] * len(between) + choice.token_versions
        self.finish_reason = choice.finish_reason
        self.num_turns += 1


def segments(calls: Sequence[_Call]) -> list[_Segment]:
    """The rows of one episode's calls, in order (see the module docstring)."""
    out: list[_Segment] = []
    for call in calls:
        prefix = [s for s in out if call.prompt_ids[: len(s.context())] == s.context()]
        for j, choice in enumerate(call.choices):
            if j == 0 and prefix:
                segment = max(prefix, key=lambda s: len(s.context()))
            else:
                segment = _Segment(list(call.prompt_ids))
                out.append(segment)
            segment.add(call.prompt_ids, choice)
    return [s for s in out if s.tokens]


@dataclass
class _Last:
    """An episode's latest call, for building its next prompt from the sampled tokens (chat.continuation): its
    messages and tools, and the recorded call itself (not a copy of its ids)."""

    messages: list[dict]
    tools: list[dict] | None
    call: _Call

    @property
    def prompt_ids(self) -> list[int]:
        return self.call.prompt_ids

    @property
    def choices(self) -> list[Choice]:
        return self.call.choices


class EpisodeRecorder:
    """Thread-safe: the server records on its event loop while a trainer takes from its own thread."""

    def __init__(self, tokenizer: Any = None, pad_token_id: int = 0) -> None:
        self.tokenizer, self.pad_token_id = tokenizer, pad_token_id
        self._calls: dict[str, list[_Call]] = {}
        self._last: dict[str, _Last] = {}
        self._lock = threading.Lock()

    def record(self, episode_id: str, prompt_ids: list[int], choices: list[Choice],
               messages: list[dict] | None = None, tools: list[dict] | None = None) -> None:
        with self._lock:
            call = _Call(list(prompt_ids), list(choices))
            self._calls.setdefault(episode_id, []).append(call)
            if messages is not None:
                self._last[episode_id] = _Last(list(messages), tools, call)
            else:
                self._last.pop(episode_id, None)

    def last(self, episode_id: str) -> _Last | None:
        with self._lock:
            return self._last.get(episode_id)

    def ids(self) -> list[str]:
        """Recorded episode ids, oldest first."""
        with self._lock:
            return list(self._calls)

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)

    def __contains__(self, episode_id: object) -> bool:
        with self._lock:
            return episode_id in self._calls

    def get(self, episode_ids: str | Sequence[str]) -> EpisodeBatch:
        """The batch of these episodes (one id or several, rows in that order), leaving them recorded."""
        ids = [episode_ids] if isinstance(episode_ids, str) else list(episode_ids)
        with self._lock:
            calls = [self._calls_of(i) for i in ids]
        return self._batch(ids, calls)

    def take(self, episode_ids: str | Sequence[str]) -> EpisodeBatch:
        """`get`, and forget them: a call of these episodes still in flight is recorded afresh when it ends."""
        ids = [episode_ids] if isinstance(episode_ids, str) else list(episode_ids)
        with self._lock:
            calls = [self._calls_of(i) for i in ids]
            for i in ids:
                self._calls.pop(i, None)
                self._last.pop(i, None)
        return self._batch(ids, calls)

    def discard(self, episode_id: str) -> None:
        with self._lock:
            self._calls.pop(episode_id, None)
            self._last.pop(episode_id, None)

    def _calls_of(self, episode_id: str) -> list[_Call]:
        if episode_id not in self._calls:
            known = list(self._calls)[:5]
            raise KeyError(f"episode_id={episode_id!r} has no recorded call (recorded: {known}"
                           f"{', ...' if len(self._calls) > 5 else ''}). Fix: pass the id the client sent as "
                           "episode_id (body) or X-Episode-Id (header), after its calls have returned")
        return list(self._calls[episode_id])

    def _batch(self, ids: list[str], calls: list[list[_Call]]) -> EpisodeBatch:
        rows, names = [], []
        for e, (episode_id, episode_calls) in enumerate(zip(ids, calls)):
            for s, seg in enumerate(segments(episode_calls)):
                versions = [v for v in seg.token_versions if v >= 0]
                rows.append(Row(e, 0, seg.prompt_ids, seg.tokens, seg.logprobs, seg.sampling_logprobs,
                                seg.finish_reason, min(versions) if versions else -1, action_mask=seg.action_mask,
                                num_turns=seg.num_turns, token_versions=seg.token_versions, segment_index=s))
                names.append(episode_id)
        batch = EpisodeBatch.from_rows(rows, pad_token_id=self.pad_token_id, tokenizer=self.tokenizer)
        return dataclasses.replace(batch, episode_ids=names)
