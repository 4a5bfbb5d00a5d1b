"""SlotTable: the sampling parameters of every scheduled request, on the device, written once per request.

A request gets a slot the first time it is scheduled to sample a token: its `RowSpec` (params and random key) is
encoded in one row of an int64 [capacity, 4] table (key, top_k, temperature and top_p as float64 bit patterns;
temperature 0 marks a greedy row) and copied to the device once. Each step then sends only the slot of each row, and
`rows(slots)` gathers the step's `SamplingRows` on the device: no per-step parameter tensors, no host round trip.
Row 0 is never handed out: a greedy default for rows that sample nothing (padding, prefill chunks).

Slots of requests the engine no longer tracks (finished, cancelled, abandoned) are reclaimed when the free list runs
out; if every slot is still live the table doubles (`on_grow` tells the runner, whose captured CUDA graphs read the
old table). Writes are enqueued on `stream` (the engine's compute stream, when it has one), so a row is rewritten only
after every step launched before has read it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

from ..base.params import SamplingParams
from .sampler import NONE, Passes, RowSpec, SamplingRows

KEY, TOP_K, TEMPERATURE, TOP_P = range(4)  # columns; TEMPERATURE and TOP_P hold float64 bit patterns
DEFAULT = RowSpec(SamplingParams(temperature=0.0))  # row 0, and every row never written


def encode(spec: RowSpec) -> torch.Tensor:
    """One table row (int64 [4]) on the host."""
    row = torch.zeros(4, dtype=torch.int64)
    row[KEY], row[TOP_K] = spec.key, spec.params.top_k
    floats = row.view(torch.float64)
    floats[TEMPERATURE] = 0.0 if spec.params.is_greedy else float(spec.params.temperature)
    floats[TOP_P] = float(spec.params.top_p)
    return row


class SlotTable:
    def __init__(self, device: torch.device, capacity: int, spec_of: Callable[[str], RowSpec],
                 is_live: Callable[[str], bool]) -> None:
        self.device = device
        self.spec_of, self.is_live = spec_of, is_live
        self.stream = None  # set by the engine once its runner exists (None on CPU)
        self.on_grow: Callable[[], None] = lambda: None
        self.table = encode(DEFAULT).expand(capacity, 4).clone().to(device)  # every row the default
        self._slot_of: dict[str, int] = {}
        self._passes = [NONE] * capacity
        self._free = list(range(capacity - 1, 0, -1))
        self._retired: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        return self.table.shape[0]

    def slots(self, request_ids: Iterable[str]) -> list[int]:
        """The slot of each request, assigning (and writing) one the first time a request is seen."""
        return [self._slot_of[rid] if rid in self._slot_of else self._assign(rid) for rid in request_ids]

    def passes(self, slots: list[int]) -> Passes:
        """The sampler passes a step of these rows needs (sampler.Passes)."""
        needed = NONE
        for slot in slots:
            needed |= self._passes[slot]
        return needed

    def rows(self, slots: torch.Tensor) -> SamplingRows:
        """The step's parameters (device tensors [N]) from its slots (int [N] on the device)."""
        rows = self.table.index_select(0, slots.long())  # [N, 4]
        floats = rows.view(torch.float64)
        temperature, greedy = floats[:, TEMPERATURE].float(), floats[:, TEMPERATURE] == 0
        return SamplingRows(temperature=temperature.masked_fill(greedy, 1.0), top_k=rows[:, TOP_K],
                            top_p=floats[:, TOP_P].float(), greedy=greedy, key=rows[:, KEY])

    def _assign(self, request_id: str) -> int:
        if not self._free:
            self._reclaim()
        if not self._free:
            self._grow()
        slot = self._free.pop()
        spec = self.spec_of(request_id)
        with self._on_stream():
            self.table[slot].copy_(encode(spec))
        self._passes[slot] = spec.passes
        self._slot_of[request_id] = slot
        return slot

    def _reclaim(self) -> None:
        for request_id in [r for r in self._slot_of if not self.is_live(r)]:
            self._free.append(self._slot_of.pop(request_id))

    def _grow(self) -> None:
        old = self.capacity
        self._retired.append(self.table)  # a step still running on another stream may read it: never freed early
        with self._on_stream():
            self.table = torch.cat([self.table, self.table[:1].expand(old, 4)])
        self._passes += [NONE] * old
        self._free = list(range(2 * old - 1, old - 1, -1))
        self.on_grow()

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

