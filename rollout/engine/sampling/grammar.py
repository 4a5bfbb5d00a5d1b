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
  [ceil(V / 32)], xgrammar's layout). The masks and their rows go to the device in one copy each, and `step(n)`
  hands the sampler the step's `Constraint`.
- `constrain(target, constraint)`: the logits a constrained row samples from at -inf wherever its bitmask has a 0
  bit, other rows untouched (sampler.py applies it after the penalties and temperature, before min-p, top-k and
  top-p).
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

from ...base.errors import invalid
from ...base.structured import Structured, grammar_of, xgrammar

@dataclass(frozen=True)
class Constraint:
    """A step's token masks on the device, one per constrained row of the step."""

    active: torch.Tensor  # bool [N]: the row is constrained
    rows: torch.Tensor  # int64 [K]: the constrained rows
    masks: torch.Tensor  # int32 [K, ceil(V / 32)]: bit t % 32 of word t // 32 is set when token t is allowed
    bits: torch.Tensor  # uint8 [8]: 1, 2, 4, ..., 128


def constrain(target: torch.Tensor, constraint: Constraint) -> torch.Tensor:
    """`target` (N, V) with every token a constrained row's mask disallows at -inf, in place (other rows untouched).
    The int32 words are read as their little-endian bytes (bit t % 8 of byte t // 8), each byte against the 8 bits,
    and the (K, V) result is scattered into an (N, V) bool mask: gathering the K float rows out of `target` and back
    (index_select) costs ten times more on CPU."""
    rows, (num_rows, vocab) = constraint.rows, target.shape
    words = constraint.masks.view(torch.uint8)  # (K, 4 x W)
    disallowed = torch.bitwise_and(words[:, :, None], constraint.bits).eq_(0).view(torch.bool)  # 0 or 1 in place
    disallowed = disallowed.view(rows.shape[0], -1)
    full = torch.zeros((num_rows, disallowed.shape[1]), dtype=torch.bool, device=target.device)
    return target.masked_fill_(full.index_copy_(0, rows, disallowed)[:, :vocab], float("-inf"))


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
            try:
                compiled = self._compiler.compile_grammar(grammar_of(structured))
            except RuntimeError as error:  # what xgrammar raises (the grammar itself was built: a tokenizer issue)
                raise invalid(structured.field, structured.kind, f"does not compile against this tokenizer: {error}",
                              "check the tokenizer, or simplify the grammar") from None
            self._compiled[structured] = compiled
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

    def __init__(self, device: torch.device, vocab_size: int,
                 grammars: Callable[[], Grammars | None] = lambda: None) -> None:
        self.device, self.vocab_size = device, vocab_size
        self.grammars = grammars  # the engine's compiler (its worker sets one before the first constrained row)
        self.stream = None  # the engine's compute stream, when it has one
        self._matched: dict[int, Matched] = {}
        self._host: torch.Tensor | None = None  # int32 [capacity, W]: the step's bitmasks, filled by the matchers
        self._masks: torch.Tensor | None = None  # the same on the device
        self._rows: torch.Tensor | None = None  # int64 [capacity] on the device: the step's constrained rows
        self._count = 0  # constrained rows of the last fill
        self._bits = (1 << torch.arange(8)).to(torch.uint8).to(device)

    def attach(self, slot: int, structured: Structured, stop_ids: tuple[int, ...]) -> None:
        grammars = self.grammars()
        if grammars is None:
            raise RuntimeError("a constrained request reached the engine without its worker's grammar compiler")
        self._matched[slot] = Matched(grammars.matcher(structured, stop_ids))

    def detach(self, slot: int) -> None:
        self._matched.pop(slot, None)

    def is_constrained(self, slot: int) -> bool:
        return slot in self._matched

    def fill(self, constrained: list[tuple[int, int, str, list[int]]]) -> None:
        """The masks of a step's constrained rows, on the device: (row, slot, request id, completion so far) each."""
        count = len(constrained)
        self._reserve(count)
        for i, (row, slot, request_id, completion) in enumerate(constrained):
            matched = self._matched[slot]
            matched.catch_up(request_id, completion)
            matched.matcher.fill_next_token_bitmask(self._host, i)
        rows = torch.tensor([row for row, *_ in constrained], dtype=torch.int64)
        with self._on_stream():
            self._masks[:count].copy_(self._host[:count], non_blocking=True)
            self._rows[:count].copy_(rows, non_blocking=True)
        self._count = count

    def step(self, rows: int) -> Constraint | None:
        """The constraint of a step of `rows` logits rows (after `fill`), or None before any constrained step."""
        if self._host is None:
            return None
        count = self._count
        constrained = self._rows[:count]
        active = torch.zeros(rows, dtype=torch.bool, device=self.device).index_fill_(0, constrained, True)
        return Constraint(active, constrained, self._masks[:count], self._bits)

    def _reserve(self, rows: int) -> None:
        """Room for `rows` masks (grown by doubling; a fill writes all it reads)."""
        capacity = 0 if self._host is None else self._host.shape[0]
        if rows <= capacity and self._host is not None:
            return
        new = max(rows, 2 * capacity, 8)
        self._host = torch.zeros((new, (self.vocab_size + 31) // 32), dtype=torch.int32)
        self._masks = self._host.to(self.device, copy=True)
        self._rows = torch.zeros(new, dtype=torch.int64, device=self.device)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
