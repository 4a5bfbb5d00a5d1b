"""Homes: which actor holds each prompt's history, so that the prompt's next group runs there.

With speculation's "history" drafts (docs/speculation.md), an actor's draft index holds the completions of the prompts
it ran; another actor has none of them. The fleet records, per prompt (its exact token ids), the actor that returned
its last group, and the dispatcher (dispatch.py) deals each prompt to that actor's chunks where the load allows. The
record is bounded (the MAX_PROMPTS most recent prompts, each a tuple of its ids: 8 bytes a token, the int objects
shared with the call), and an actor's entries are dropped when it is replaced (its successor starts with an empty
history). Off (no record) when the fleet's workers keep no history.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from ..base.config import WorkerConfig

MAX_PROMPTS = 65536


class Homes:
    def __init__(self, config: WorkerConfig, capacity: int = MAX_PROMPTS) -> None:
        spec = config.speculation
        self.enabled = spec is not None and spec.mode != "off" and "history" in spec.drafts
        self.capacity = capacity
        self._slots: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, prompts: Sequence[Sequence[int]]) -> list[int | None] | None:
        """Each prompt's home actor (None: none known); None altogether when the fleet keeps no history."""
        if not self.enabled:
            return None
        with self._lock:
            return [self._slots.get(tuple(p)) for p in prompts]

    def ran(self, prompt: Sequence[int], slot: int) -> None:
        """`slot` returned a group of `prompt`: its history now holds it."""
        if not self.enabled:
            return
        key = tuple(prompt)
        with self._lock:
            self._slots[key] = slot
            self._slots.move_to_end(key)
            while len(self._slots) > self.capacity:
                self._slots.popitem(last=False)

    def forget(self, slot: int) -> None:
        """The actor in `slot` was replaced: its history is gone."""
        with self._lock:
            for key in [k for k, s in self._slots.items() if s == slot]:
                del self._slots[key]
