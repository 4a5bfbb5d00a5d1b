"""The collector's prompt stream: each prompt drawn becomes a group with its position in the stream."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..base.batch import RolloutBatch
from ..base.errors import invalid, preview
from ..base.params import SamplingParams


@dataclass(eq=False)
class PromptGroup:
    """One prompt's group, from the prompt stream to a batch."""

    draw: int  # the prompt's position in the stream: the batch's prompt_index
    prompt: Any
    params: SamplingParams | None = None  # how its samples are drawn (set when it is first submitted)
    batch: RolloutBatch | None = None  # its rows, rewarded, once finished
    accepted: bool = False
    error: str = ""
    carried: bool = False  # in flight (or finished, unused) when an earlier call returned


class PromptSource:
    """The prompt stream: a list used once (or cycled), or any iterable read lazily; prompts put back (a stale or
    refused wave's) come out first, with their original stream positions."""

    def __init__(self, prompts: Iterable[Any], cycle: bool) -> None:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
            raise invalid("prompts", preview(prompts), "must be a list of prompts or an iterable of them",
                          "pass e.g. [[1, 2, 3], 'some text'] or a generator")
        if cycle and not isinstance(prompts, Sequence):
            raise invalid("cycle", cycle, "needs a list of prompts (an iterator cannot be repeated)",
                          "pass a list, or cycle=False")
        if isinstance(prompts, Sequence) and len(prompts) == 0:
            raise invalid("prompts", "[]", "must not be empty", "pass at least one prompt")
        self._iter = iter(_cycled(prompts) if cycle else prompts)
        self._back: deque[PromptGroup] = deque()
        self._next_draw = 0
        self._lock = threading.Lock()
        self._iter_done = False

    @property
    def exhausted(self) -> bool:
        return self._iter_done and not self._back

    def take(self, count: int) -> list[PromptGroup]:
        out = []
        with self._lock:
            while len(out) < count and self._back:
                out.append(self._back.popleft())
            while len(out) < count and not self._iter_done:
                try:
                    prompt = next(self._iter)
                except StopIteration:
                    self._iter_done = True
                    break
                out.append(PromptGroup(self._next_draw, prompt))
                self._next_draw += 1
        return out

    def put_back(self, groups: list[PromptGroup]) -> None:
        with self._lock:
            self._back.extendleft(reversed(groups))


def _cycled(items: Sequence[Any]):
    while True:
        yield from items
