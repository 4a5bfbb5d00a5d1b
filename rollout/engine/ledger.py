"""Ledger: what the engine keeps per engine request between its sampled tokens and its output.

For every live request id: its `RowSpec` (sampling params and seeded generator), and per sampled token the sampling
logprob and the policy version whose weights produced it. Entries exist only for requests the engine tracks
(`is_tracked`): a token sampled for a request already cancelled is not recorded, and `drop` releases everything a
cancelled request held, so cancellations (timeouts, aborts) leave nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .sampler import RowSpec


class Ledger:
    def __init__(self, is_tracked: Callable[[str], bool]) -> None:
        self.is_tracked = is_tracked
        self.specs: dict[str, RowSpec] = {}
        self.sampling: dict[str, list[float]] = {}
        self.versions: dict[str, list[int]] = {}

    def record(self, request_ids: list[str], values: list[float], version: int) -> None:
        """One step's sampled tokens (engine thread)."""
        for request_id, value in zip(request_ids, values):
            if self.is_tracked(request_id):
                self.sampling.setdefault(request_id, []).append(value)
                self.versions.setdefault(request_id, []).append(version)

    def pop(self, request_id: str) -> tuple[list[float], list[int]]:
        """A finished request's sampling logprobs and token versions; its entries are released."""
        self.specs.pop(request_id, None)
        return self.sampling.pop(request_id, []), self.versions.pop(request_id, [])

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.pop(request_id)

    def clear(self) -> None:
        self.specs.clear()
        self.sampling.clear()
        self.versions.clear()

    def __len__(self) -> int:
        return len(self.specs) + len(self.sampling) + len(self.versions)
