"""Draft tokens for speculative rollouts: n-gram lookups in a row's own tokens and in earlier completions.

Pure Python, on the host, called per decoding row per step, so every lookup is a handful of dict probes:

- `DraftIndex` (one per engine) holds the "history": for each prompt (its exact ids), the completions recorded for it
  (`record`: earlier calls and epochs, and samples of the same group that finished earlier in this call) and an index
  from every n-gram of them (min_ngram..max_ngram tokens, the prompt's last tokens included, so a row is drafted from
  its first token) to what followed its last occurrence in the most recent completion, built by the first lookup
  that needs a completion (recording one only stores its tokens). Bounded by
  `history_memory_mb`: past it, whole prompts are forgotten, least recently used (recorded or drafted for) first;
  a prompt also keeps only its `MAX_COMPLETIONS` most recent completions.
- `RowDrafts` (one per request, from `DraftIndex.row(prompt)`) holds the row's tokens and, for "context", an index
  from every n-gram of them to the position after its most recent occurrence, updated by `extend` (never rescanned).
  `propose(k)` looks up the row's last max_ngram tokens, then shorter suffixes down to min_ngram: the longest suffix
  any source knows wins; at equal length, the source named first in `Speculation.drafts`. A "context" match copies
  what followed it (past the row's end as the repeat it implies: "a b c a b" proposes "c a b ..."); a "history" match
  copies the rest of that completion, up to k tokens.

A draft is only ever a guess that the engine verifies, so a source that raises is dropped for that row (logged once)
and the row drafts from the others, or not at all; no exception leaves `record`, `row`, `extend` or `propose`.

Cost (CPython 3.11, process CPU time on this project's shared 2-core machine; `test_propose_is_cheap` bounds it):
propose(4) on a row of 300 tokens with both sources: 0.6-1.0 us on a hit, 1.3-1.5 us when no suffix matches (every
length tried in both); extend, and indexing a recorded completion at its first lookup, ~1.5 us per token (recording
it ~0.1 us); row() indexes a new prompt once
(~0.2-0.3 ms for 300 tokens) and the other samples of that prompt copy its index (~15 us).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from ...base.speculation import Speculation

LOG = logging.getLogger("rollout")

MAX_COMPLETIONS = 32  # per prompt: four epochs of n = 8; older ones are dropped when twice as many are held
POSITION_STRIDE = 1 << 32  # a history index value: completion number * POSITION_STRIDE + the follower's position
# What the history holds, in bytes (CPython 3.11, 64-bit; tests/test_drafts.py checks it against tracemalloc):
TOKEN_BYTES = 4  # a stored completion token: an int32 in its completion's array
COMPLETION_BYTES = 120  # a stored completion: its array object and its slot in the prompt's list
INDEX_ENTRY_BYTES = 112  # an n-gram: its dict slot, its key tuple (2-4 slots) and its value int
PROMPT_OVERHEAD_BYTES = 400  # a prompt's record: its object, its lists, its index dict when empty


class ContextSource:
    """The row's own n-grams: each maps to the position after its most recent occurrence (the row's last tokens
    excluded, so a lookup of the current suffix finds an earlier occurrence)."""

    name = "context"
    keyed = True  # proposes by n-gram lookup (draft_model.ModelSource does not)

    def __init__(self, tokens: list[int], min_ngram: int, max_ngram: int,
                 prompt_index: dict[tuple[int, ...], int] | None = None) -> None:
        """`prompt_index`: the index of these very tokens (another sample of the same prompt's), copied."""
        self.tokens, self.min_ngram, self.max_ngram = tokens, min_ngram, max_ngram
        self.index: dict[tuple[int, ...], int] = {} if prompt_index is None else prompt_index.copy()
        self.indexed = 1 if prompt_index is None else len(tokens)  # n-grams ending before `indexed` are indexed
        self.advance()

    def advance(self) -> None:
        """Index the n-grams that end before each token appended since the last call."""
        tokens, index, low, high = self.tokens, self.index, self.min_ngram, self.max_ngram
        for follower in range(self.indexed, len(tokens)):
            for n in range(low, min(high, follower) + 1):
                index[tuple(tokens[follower - n: follower])] = follower
        self.indexed = max(len(tokens), 1)

    def lookup(self, key: tuple[int, ...], k: int) -> list[int] | None:
        start = self.index.get(key)
        if start is None:
            return None
        tokens = self.tokens
        draft = tokens[start: start + k]
        period = len(tokens) - start
        while len(draft) < k:  # past the row's end the match continues as a repeat of period `period`
            draft.append(draft[len(draft) - period])
        return draft


class PromptHistory:
    """One prompt's recorded completions and the index of their n-grams. A completion is indexed when a lookup first
    needs it, not when it is recorded: where "auto" drafts nothing (a random model, compute-bound steps), indexing
    every finished row was the largest part of what speculation cost the engine (~5% of a tiny model's loop).
    `state` is swapped whole when old completions are dropped, so a lookup reads one consistent (completions,
    index, number indexed)."""

    __slots__ = ("prompt", "tail", "min_ngram", "max_ngram", "state", "tokens", "grown")

    def __init__(self, prompt: tuple[int, ...], min_ngram: int, max_ngram: int,
                 grown: Callable[["PromptHistory", int], None] = lambda history, nbytes: None) -> None:
        self.prompt, self.tail = prompt, prompt[-max_ngram:]  # `prompt`: the owner's key (the same tuple)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.state: tuple[list[array], dict[tuple[int, ...], int], int] = ([], {}, 0)
        self.tokens = 0  # completion tokens held
        self.grown = grown  # told the bytes indexing added (the owner's memory budget)

    def add(self, completion: Sequence[int]) -> None:
        completion = array("i", completion)  # 4 bytes a token (a tuple's slots and int objects: 8-40)
        completions = self.state[0]
        if len(completions) >= 2 * MAX_COMPLETIONS:
            kept = completions[-MAX_COMPLETIONS:]
            self.state, self.tokens = (kept, {}, 0), sum(map(len, kept))  # indexed again when next looked up
            completions = kept
        completions.append(completion)
        self.tokens += len(completion)

    def lookup(self, key: tuple[int, ...], k: int) -> list[int] | None:
        completions, index, indexed = self.state
        if indexed < len(completions):
            completions, index, _ = self._index()
        value = index.get(key)
        if value is None:
            return None
        number, start = divmod(value, POSITION_STRIDE)
        return list(completions[number][start: start + k]) or None

    def _index(self) -> tuple:
        """Index the completions recorded since the last lookup, the most recent last (its n-grams win)."""
        completions, index, indexed = self.state
        before = len(index)
        low, high, tail = self.min_ngram, self.max_ngram, self.tail
        offset = len(tail)
        for number in range(indexed, len(completions)):
            seq = tail + tuple(completions[number])
            for follower in range(offset, len(seq)):
                value = number * POSITION_STRIDE + follower - offset
                for n in range(low, min(high, follower) + 1):
                    index[seq[follower - n: follower]] = value
        self.state = (completions, index, len(completions))
        self.grown(self, INDEX_ENTRY_BYTES * (len(index) - before))
        return self.state

    @property
    def nbytes(self) -> int:
        completions, index, _ = self.state
        return (PROMPT_OVERHEAD_BYTES + TOKEN_BYTES * self.tokens + COMPLETION_BYTES * len(completions)
                + INDEX_ENTRY_BYTES * len(index))


class HistorySource:
    """A row's view of its prompt's history (the `PromptHistory` current when the row started)."""

    name = "history"
    keyed = True

    def __init__(self, history: PromptHistory) -> None:
        self.history = history

    def advance(self) -> None:
        pass

    def lookup(self, key: tuple[int, ...], k: int) -> list[int] | None:
        return self.history.lookup(key, k)


class RowDrafts:
    """One request's drafter: its tokens (prompt + accepted completion) and its sources, in preference order."""

    def __init__(self, tokens: list[int], sources: list, min_ngram: int, max_ngram: int) -> None:
        self.tokens, self.sources = tokens, sources
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def extend(self, tokens: Sequence[int]) -> None:
        """Append the tokens the row accepted since the last call, in order."""
        self.tokens.extend(tokens)
        for source in list(self.sources):
            try:
                source.advance()
            except Exception as error:  # noqa: BLE001 - a failing source only costs its drafts
                self._drop(source, error)

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens that continue the row: the longest suffix match of any n-gram source, else the draft
        model's (free lookups first: a draft model's costs forwards); [] if none."""
        tokens = self.tokens
        length = len(tokens)
        if k < 1 or not self.sources:
            return []
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            key = tuple(tokens[length - n:])
            for source in self.sources:
                if not source.keyed:
                    continue
                try:
                    draft = source.lookup(key, k)
                except Exception as error:  # noqa: BLE001
                    self._drop(source, error)
                    return []
                if draft:
                    return draft
        for source in [s for s in self.sources if not s.keyed]:
            try:
                return source.draft(k)
            except Exception as error:  # noqa: BLE001
                self._drop(source, error)
        return []

    def _drop(self, source, error: Exception) -> None:
        self.sources = [s for s in self.sources if s is not source]
        LOG.warning("draft source %r failed (%s: %s); the row goes on without it", getattr(source, "name", source),
                    type(error).__name__, error)


class DraftIndex:
    """The engine's draft sources: the bounded history of completions per prompt, and a `RowDrafts` per request.

    Safe for one engine thread plus callers: `record`, `row` and `clear` take a lock; a `RowDrafts` is used by one
    thread at a time.
    """

    def __init__(self, spec: Speculation, draft_model: Any = None) -> None:
        self.spec = spec
        self.draft_model = draft_model  # draft_model.DraftModel: the "model" source's runner (None without it)
        self.budget = int(spec.history_memory_mb * 2**20)
        self._prompts: OrderedDict[tuple[int, ...], PromptHistory] = OrderedDict()
        self._bytes = 0
        self._last_prompt: tuple[tuple[int, ...], dict[tuple[int, ...], int]] | None = None
        self._guard = threading.Lock()

    @property
    def memory_bytes(self) -> int:
        """What the history holds now, in bytes (estimated per token and index entry; <= history_memory_mb)."""
        return self._bytes

    def record(self, prompt: Sequence[int], completion: Sequence[int]) -> None:
        """Remember a finished model turn's completion for its prompt (no-op without "history")."""
        if "history" not in self.spec.drafts or not completion:
            return
        try:
            with self._guard:
                history = self._history(tuple(prompt))
                before = history.nbytes
                history.add(completion)
                self._bytes += history.nbytes - before
                self._evict()
        except Exception as error:  # noqa: BLE001 - history is an optimisation; the engine must not see this
            LOG.warning("draft history not recorded (%s: %s)", type(error).__name__, error)

    def row(self, prompt: Sequence[int], sampling: Any = None) -> RowDrafts:
        """A drafter for a new request with these prompt ids; `sampling`: its sampler.RowSpec, which the draft model
        draws with (None: argmax drafts)."""
        spec, tokens = self.spec, list(prompt)
        key, sources = tuple(tokens), []
        for name in spec.drafts:
            try:
                with self._guard:
                    if name == "context":
                        sources.append(self._context(tokens, key))
                    elif name == "history":
                        sources.append(HistorySource(self._history(key)))
                        self._evict()
                    elif name == "model" and self.draft_model is not None:
                        sources.append(self.draft_model.source(tokens, sampling))
            except Exception as error:  # noqa: BLE001
                LOG.warning("draft source %r not started (%s: %s)", name, type(error).__name__, error)
        return RowDrafts(tokens, sources, spec.min_ngram, spec.max_ngram)

    def holds(self, prompt: Sequence[int]) -> bool:
        """Whether the history holds a completion of this prompt (e.g. to route a group where its drafts are)."""
        with self._guard:
            history = self._prompts.get(tuple(prompt))
            return history is not None and history.tokens > 0

    def clear(self) -> None:
        """Forget every recorded completion (rows already started keep what they hold)."""
        with self._guard:
            self._prompts.clear()
            self._bytes = 0
            self._last_prompt = None

    def _context(self, tokens: list[int], key: tuple[int, ...]) -> ContextSource:
        """A context source for a new row; the n samples of one prompt start one after another, so the last
        prompt's index is kept and copied (~20x cheaper than indexing the prompt again). Under the lock."""
        spec, last = self.spec, self._last_prompt
        if last is not None and last[0] == key:
            return ContextSource(tokens, spec.min_ngram, spec.max_ngram, last[1])
        source = ContextSource(tokens, spec.min_ngram, spec.max_ngram)
        self._last_prompt = (key, source.index.copy())  # a snapshot: the row's own index grows with it
        return source

    def _history(self, prompt: tuple[int, ...]) -> PromptHistory:
        """The prompt's history, made the most recently used (created empty if new). Under the lock."""
        history = self._prompts.get(prompt)
        if history is None:
            history = self._prompts[prompt] = PromptHistory(prompt, self.spec.min_ngram, self.spec.max_ngram,
                                                            self._grown)
            self._bytes += history.nbytes
        else:
            self._prompts.move_to_end(prompt)
        return history

    def _grown(self, history: PromptHistory, nbytes: int) -> None:
        """A lookup indexed completions of `history` (on the engine thread): their bytes count, if it is still held."""
        with self._guard:
            if self._prompts.get(history.prompt) is history:
                self._bytes += nbytes
                self._evict()

    def _evict(self) -> None:
        while self._bytes > self.budget and self._prompts:
            _, history = self._prompts.popitem(last=False)
            self._bytes -= history.nbytes
