"""Ledger: what the engine keeps per engine request between its sampled tokens and its output.

For every live request id: its `RowSpec` (sampling params and the key of its counter-based random stream,
streams.py), and per sampled token the sampling logprob, the policy version whose weights produced it and, when
its params ask for `top_logprobs`, the top ids and logprobs at that position. Entries exist only for requests the engine tracks
(`is_tracked`): a token sampled for a request already cancelled is not recorded, and `drop` releases everything a
cancelled request held, so cancellations (timeouts, aborts) leave nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..sampling.sampler import RowSpec

Top = tuple[list[int], list[float]]  # one position's most likely token ids and their logprobs


@dataclass
class Entry:
    """What a finished request hands back from the ledger, one item per sampled token."""

    sampling: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[Top] | None = None  # None unless its params ask for top_logprobs


class Ledger:
    def __init__(self, is_tracked: Callable[[str], bool]) -> None:
        self.is_tracked = is_tracked
        self.specs: dict[str, RowSpec] = {}
        self.sampling: dict[str, list[float]] = {}
        self.versions: dict[str, list[int]] = {}
        self.tops: dict[str, list[Top]] = {}

    def record(self, request_ids: list[str], values: list[float], version: int,
               top: Callable[[int, int], Top] | None = None) -> None:
        """One step's sampled tokens (engine thread). `top(i, k)`: the k top (ids, logprobs) of the i-th one."""
        for i, (request_id, value) in enumerate(zip(request_ids, values)):
            if self.is_tracked(request_id):
                self.sampling.setdefault(request_id, []).append(value)
                self.versions.setdefault(request_id, []).append(version)
                spec = self.specs.get(request_id)
                if top is not None and spec is not None and spec.params.top_logprobs:
                    self.tops.setdefault(request_id, []).append(top(i, spec.params.top_logprobs))

    def pop(self, request_id: str) -> Entry:
        """A finished request's sampling logprobs, token versions and top lists; its entries are released."""
        spec = self.specs.pop(request_id, None)
        tops = self.tops.pop(request_id, [])
        wants_top = spec is not None and spec.params.top_logprobs > 0
        return Entry(self.sampling.pop(request_id, []), self.versions.pop(request_id, []), tops if wants_top else None)

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.pop(request_id)

    def clear(self) -> None:
        self.specs.clear()
        self.sampling.clear()
        self.versions.clear()
        self.tops.clear()

    def __len__(self) -> int:
        return len(self.specs) + len(self.sampling) + len(self.versions) + len(self.tops)


def split_tops(tops: list[Top] | None, count: int) -> tuple[list[list[int]] | None, list[list[float]] | None]:
    """A request's per-token (ids, logprobs) top lists as a Row's two per-token lists (None when not asked)."""
    if tops is None:
        return None, None
    return [ids for ids, _ in tops[:count]], [values for _, values in tops[:count]]
