"""Constrained rows (`SamplingParams.structured`): grammars compiled against the tokenizer, matchers advanced on the
host, and each step's token masks applied on the device before sampling.

- `Grammars(tokenizer, vocab_size)`: a worker's xgrammar compiler (its HF tokenizer as xgrammar's TokenizerInfo, the
  model's vocabulary size: ids past the tokenizer's are never allowed); `compile(structured)` compiles each distinct
  `Structured` once (cached), `matcher(structured, stop_ids)` starts one request's matcher, which allows the
  request's own stop ids, and only once the grammar is complete.
- `GrammarTable`, owned by the SlotTable: one matcher per constrained slot, with how many completion tokens it has
  accepted. While a step's inputs are prepared (`fill`), each constrained row's matcher accepts the tokens its request
  gained since (the SlotTable reads them from the request's state: with sync batching the previous step's token is
  there, and a preempted request keeps its slot, matcher and tokens) and writes the row's next-token bitmask (int32
  [ceil(V / 32)], xgrammar's layout); every other row gets all ones. The masks go to the device in one copy, and
  `step(n)` hands the sampler the step's `Constraint`.
- `constrain(target, constraint)`: the logits a row samples from at -inf wherever its bitmask has a 0 bit (sampler.py
  applies it after the penalties and temperature, before min-p, top-k and top-p).
A step with no constrained row fills nothing and runs no mask pass (`Passes.constrain`). Async batching (CUDA graphs)
prepares a step before the previous step's token is read back, so it cannot know the next mask: the worker refuses
constrained requests there (`WorkerConfig(cuda_graphs="off")` is the fix it names).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..base.structured import Structured, grammar_of, xgrammar

ALL_ALLOWED = -1  # an int32 word with every bit set


@dataclass(frozen=True)
class Constraint:
    """A step's token masks on the device: one row per sampling row of the step (all ones: unconstrained)."""

    active: torch.Tensor  # bool [N]: the row is constrained
    masks: torch.Tensor  # int32 [N, ceil(V / 32)]: bit t % 32 of word t // 32 is set when token t is allowed
    word: torch.Tensor  # int64 [V]: t // 32
    bit: torch.Tensor  # int32 [V]: t % 32


def constrain(target: torch.Tensor, constraint: Constraint) -> torch.Tensor:
    """`target` (N, V) with every token a row's mask disallows at -inf, in place."""
    words = constraint.masks.index_select(1, constraint.word)  # (N, V) int32: each token's word
    disallowed = words.bitwise_right_shift_(constraint.bit).bitwise_and_(1).eq(0)
    return target.masked_fill_(disallowed, float("-inf"))


class Grammars:
    """The compiler of one worker (its tokenizer and vocabulary size), and its compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = xgrammar()
        self.vocab_size = vocab_size
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
        self._compiled: dict[Structured, Any] = {}

    def compile(self, structured: Structured) -> Any:
        """The CompiledGrammar of a value (once per distinct value; called by the worker before submitting)."""
        compiled = self._compiled.get(structured)
        if compiled is None:
            compiled = self._compiled[structured] = self._compiler.compile_grammar(grammar_of(structured))
        return compiled

    def matcher(self, structured: Structured, stop_ids: tuple[int, ...]) -> Any:
        """A fresh matcher of the value's grammar that ends on the request's own stop ids."""
        return self._xgr.GrammarMatcher(self.compile(structured), override_stop_tokens=list(stop_ids))


class Matched:
    """One constrained request's matcher and how many of its completion tokens it has accepted."""

    def __init__(self, matcher: Any) -> None:
        self.matcher, self.seen = matcher, 0

    def catch_up(self, request_id: str, completion: list[int]) -> None:
        for token in completion[self.seen:]:
            if not self.matcher.accept_token(token):  # the mask allowed it: a broken invariant, never a silent row
                raise RuntimeError(f"request {request_id}: sampled token {token} is not allowed by its grammar")
        self.seen = len(completion)


class GrammarTable:
    """The matchers of constrained slots and the step's masks (see the module docstring)."""

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device, self.vocab_size = device, vocab_size
        self.grammars: Callable[[], Grammars | None] = lambda: None  # the engine's (set by its worker)
        self.stream = None  # the engine's compute stream, when it has one
        self._matched: dict[int, Matched] = {}
        self._host: torch.Tensor | None = None  # int32 [capacity, W]: the step's bitmasks, filled by the matchers
        self._masks: torch.Tensor | None = None  # the same on the device
        self._active: torch.Tensor | None = None  # bool [capacity] on the device
        self._written = 0  # rows the last fill wrote (reset to all ones by the next)
        ids = torch.arange(vocab_size, device=device)
        self._word, self._bit = ids // 32, (ids % 32).to(torch.int32)

    def attach(self, slot: int, structured: Structured, stop_ids: tuple[int, ...]) -> None:
        grammars = self.grammars()
        if grammars is None:
            raise RuntimeError("a constrained request reached the engine without its worker's grammar compiler")
        self._matched[slot] = Matched(grammars.matcher(structured, stop_ids))

    def detach(self, slot: int) -> None:
        self._matched.pop(slot, None)

    def is_constrained(self, slot: int) -> bool:
        return slot in self._matched

    def fill(self, count: int, constrained: list[tuple[int, int, str, list[int]]]) -> None:
        """The masks of a step's `count` sampling rows, on the device. `constrained`: (row, slot, request id,
        completion so far) of each constrained one; the others are left unconstrained."""
        self._reserve(count)
        host = self._host
        host[:count].fill_(ALL_ALLOWED)
        active = torch.zeros(count, dtype=torch.bool)
        for row, slot, request_id, completion in constrained:
            matched = self._matched[slot]
            matched.catch_up(request_id, completion)
            matched.matcher.fill_next_token_bitmask(host, row)
            active[row] = True
        with self._on_stream():
            self._masks[:count].copy_(host[:count], non_blocking=True)
            self._masks[count:self._written].fill_(ALL_ALLOWED)
            self._active.zero_()[:count].copy_(active, non_blocking=True)
        self._written = count

    def step(self, rows: int) -> Constraint | None:
        """The step's constraint for its first `rows` logits rows (sampling rows first; rows `fill` did not write are
        unconstrained), or None before any constrained step (nothing allocated)."""
        if self._host is None:
            return None
        self._reserve(rows)
        return Constraint(self._active[:rows], self._masks[:rows], self._word, self._bit)

    def _reserve(self, rows: int) -> None:
        """Room for `rows` rows; the rows held so far are kept (grown by doubling)."""
        capacity = 0 if self._host is None else self._host.shape[0]
        if rows <= capacity:
            return
        new = max(rows, 2 * capacity, 8)
        host = torch.full((new, (self.vocab_size + 31) // 32), ALL_ALLOWED, dtype=torch.int32)
        masks = host.to(self.device, copy=True)
        active = torch.zeros(new, dtype=torch.bool, device=self.device)
        if capacity:
            host[:capacity], masks[:capacity], active[:capacity] = self._host, self._masks, self._active
        self._host, self._masks, self._active = host, masks, active

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
