"""ResponseStore: the responses this server keeps for `previous_response_id` and `GET /v1/responses/{id}`.

In memory and bounded: the newest `capacity` responses (1024 by default), least recently used first out; a server
restart forgets them all. A response created with `store: false` is never put here. Each entry keeps what a next turn
needs to continue the conversation without re-tokenizing it: the messages rendered, the prompt's ids and the tokens
the model sampled, besides the response body itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object as returned
    messages: list[dict]  # every message its prompt rendered (instructions first, if any)
    history: list[dict]  # the conversation a next turn continues: without instructions, with the assistant's reply
    tools: list[dict] | None  # the chat tools its prompt rendered
    prompt_ids: list[int]
    completion_ids: list[int]


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} is invalid: must be >= 1")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
