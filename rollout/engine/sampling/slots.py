"""SlotTable: the sampling parameters of every scheduled request, on the device, written once per request.

A request gets a slot the first time it is scheduled to sample a token: its `RowSpec` (params and random key) is
encoded in one row of an int64 [capacity, WIDTH] table (key, top_k, the row's min_new_tokens as the position it
lasts to, its AdjustTable row, and temperature, top_p, min_p and the penalties as float64 bit patterns; temperature 0
marks a greedy row) and copied to the device once; a request that asks for penalties, a logit bias or
min_new_tokens also gets a row of the `AdjustTable` (penalties.py), written from its own tokens; a constrained one
(`SamplingParams.structured`) a matcher of its grammar in the `GrammarTable` (grammar.py), whose masks are written
before each step that samples for it. Each step then sends
only the slot of each row, and `rows(slots)` gathers the step's `SamplingRows` on the device: no per-step parameter
tensors, no host round trip. Row 0 is never handed out: a greedy default for rows that sample nothing (padding,
prefill chunks). A preempted request that adjusts its logits gives its slot back (`forget`): the token an async step
sampled for it is dropped by the engine but was counted on the device, so its next slot is written again from the
tokens it really holds.

Slots of requests the engine no longer tracks (finished, cancelled, abandoned) are reclaimed when the free list runs
out; if every slot is still live the table doubles (`on_grow` tells the runner, whose captured CUDA graphs read the
old table). Writes are enqueued on `stream` (the engine's compute stream, when it has one), so a row is rewritten only
after every step launched before has read it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

from ...base.params import SamplingParams
from .grammar import Grammars, GrammarTable
from .penalties import Adjust, AdjustTable
from ..upstream import history
from .sampler import ALL, NONE, Passes, RowSpec, SamplingRows

# columns; TEMPERATURE to REPETITION hold float64 bit patterns
KEY, TOP_K, MIN_POSITION, ADJUST_ROW, TEMPERATURE, TOP_P, MIN_P, FREQUENCY, PRESENCE, REPETITION = range(10)
WIDTH = 10
DEFAULT = RowSpec(SamplingParams(temperature=0.0))  # row 0, and every row never written


def encode(spec: RowSpec, min_position: int = 0, adjust_row: int = 0) -> torch.Tensor:
    """One table row (int64 [WIDTH]) on the host."""
    p = spec.params
    row = torch.zeros(WIDTH, dtype=torch.int64)
    row[KEY], row[TOP_K], row[MIN_POSITION], row[ADJUST_ROW] = spec.key, p.top_k, min_position, adjust_row
    floats = row.view(torch.float64)
    floats[TEMPERATURE] = 0.0 if p.is_greedy else float(p.temperature)
    floats[TOP_P], floats[MIN_P] = float(p.top_p), 0.0 if p.is_greedy else float(p.min_p)
    floats[FREQUENCY], floats[PRESENCE] = float(p.frequency_penalty), float(p.presence_penalty)
    floats[REPETITION] = float(p.repetition_penalty)
    return row


class SlotTable:
    def __init__(self, device: torch.device, capacity: int, spec_of: Callable[[str], RowSpec],
                 is_live: Callable[[str], bool], vocab_size: int = 0,
                 grammars: Callable[[], Grammars | None] = lambda: None) -> None:
        self.device = device
        self.spec_of, self.is_live = spec_of, is_live
        self._stream = None
        self.on_grow: Callable[[], None] = lambda: None
        self.table = encode(DEFAULT).expand(capacity, WIDTH).clone().to(device)  # every row the default
        self.adjust = AdjustTable(device, vocab_size)
        self.grammar = GrammarTable(device, vocab_size, grammars)  # constrained requests' matchers and each step's masks
        self._slot_of: dict[str, int] = {}
        self._passes = [NONE] * capacity
        self._adjust_rows = [0] * capacity
        self._free = list(range(capacity - 1, 0, -1))
        self._retired: list[torch.Tensor] = []

    @property
    def stream(self):
        """The engine's compute stream, set once its runner exists (None on CPU): writes are enqueued on it."""
        return self._stream

    @stream.setter
    def stream(self, stream) -> None:
        self._stream = self.adjust.stream = self.grammar.stream = stream

    @property
    def adjusting(self) -> bool:
        """Some request has asked for penalties, a bias or min_new_tokens (the AdjustTable is allocated)."""
        return self.adjust.capacity > 0

    @property
    def capacity(self) -> int:
        return self.table.shape[0]

    def slots(self, states: Iterable) -> list[int]:
        """The slot of each request (upstream RequestStates), assigning (and writing) one the first time a request is
        seen."""
        return [self._slot_of.get(state.request_id) or self._assign(state) for state in states]

    def forget(self, request_ids: Iterable[str]) -> None:
        """Preempted requests: those that adjust their logits give their slot back (see the module docstring)."""
        for request_id in request_ids:
            slot = self._slot_of.get(request_id)
            if slot is not None and self._passes[slot].adjust:
                self._release(self._slot_of.pop(request_id))

    def is_constrained(self, slot: int) -> bool:
        """The slot's request samples under a grammar (SamplingParams.structured): it cannot be drafted ahead."""
        return self.grammar.is_constrained(slot)

    def constrain(self, states: list, slots: list[int]) -> None:
        """Before a step whose rows (`states`, their `slots`) include constrained ones (`Passes.constrain`): each
        one's grammar mask from its matcher, advanced over the tokens its request holds now (grammar.py)."""
        constrained = [(row, slot, state.request_id, history(state)[1])
                       for row, (state, slot) in enumerate(zip(states, slots)) if self.grammar.is_constrained(slot)]
        self.grammar.fill(constrained)

    def passes(self, slots: list[int]) -> Passes:
        """The sampler passes a step of these rows needs (sampler.Passes)."""
        needed = NONE
        for slot in slots:
            needed |= self._passes[slot]
        return needed

    def rows(self, slots: torch.Tensor, passes: Passes = ALL) -> SamplingRows:
        """The step's parameters (device tensors [N]) from its slots (int [N] on the device); min-p and the
        adjustments only when `passes` asks for them (and, for adjustments, once some request has)."""
        rows = self.table.index_select(0, slots.long())  # [N, WIDTH]
        floats = rows.view(torch.float64)
        temperature, greedy = floats[:, TEMPERATURE].float(), floats[:, TEMPERATURE] == 0
        return SamplingRows(temperature=temperature.masked_fill(greedy, 1.0), top_k=rows[:, TOP_K],
                            top_p=floats[:, TOP_P].float(), greedy=greedy, key=rows[:, KEY],
                            min_p=floats[:, MIN_P].float() if passes.min_p else None,
                            adjust=self._adjust(rows) if passes.adjust and self.adjusting else None,
                            constraint=self.grammar.step(rows.shape[0]) if passes.constrain else None)

    def count(self, rows: SamplingRows, tokens: torch.Tensor) -> None:
        """After a step with the adjust pass: count each adjusting row's sampled token (device work only)."""
        if rows.adjust is not None:
            self.adjust.count(rows.adjust, tokens)

    def _adjust(self, rows: torch.Tensor) -> Adjust:
        floats, index = rows.view(torch.float64), rows[:, ADJUST_ROW]
        return Adjust(active=index > 0, frequency=floats[:, FREQUENCY].float(), presence=floats[:, PRESENCE].float(),
                      repetition=floats[:, REPETITION].float(), min_position=rows[:, MIN_POSITION], rows=index,
                      table=self.adjust)

    def _assign(self, state) -> int:
        if not self._free:
            self._reclaim()
        if not self._free:
            self._grow()
        slot = self._free.pop()
        spec = self.spec_of(state.request_id)
        min_position = adjust_row = 0
        if spec.params.adjusts_logits:
            if self.adjust.full:  # rows of finished requests first: the table grows only past the live ones
                self._reclaim()
            prompt, completion = history(state)
            adjust_row, grown = self.adjust.write(spec.params, spec.stop_ids, prompt, completion)
            min_position = len(prompt) - 1 + spec.params.min_new_tokens if spec.params.min_new_tokens else 0
            if grown:
                self.on_grow()
        if spec.params.is_constrained:
            self.grammar.attach(slot, spec.params.structured, spec.stop_ids)
        with self._on_stream():
            self.table[slot].copy_(encode(spec, min_position, adjust_row))
        self._passes[slot], self._adjust_rows[slot] = spec.passes, adjust_row
        self._slot_of[state.request_id] = slot
        return slot

    def _release(self, slot: int) -> None:
        self.adjust.free(self._adjust_rows[slot])
        self.grammar.detach(slot)
        self._adjust_rows[slot] = 0
        self._free.append(slot)

    def _reclaim(self) -> None:
        for request_id in [r for r in self._slot_of if not self.is_live(r)]:
            self._release(self._slot_of.pop(request_id))

    def _grow(self) -> None:
        old = self.capacity
        self._retired.append(self.table)  # a step still running on another stream may read it: never freed early
        with self._on_stream():
            self.table = torch.cat([self.table, self.table[:1].expand(old, WIDTH)])
        self._passes += [NONE] * old
        self._adjust_rows += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1))
        self.on_grow()

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

